"""Plugin contracts as functions: the checks every plugin of a kind must pass.

mmrl's own contract tests (tests/test_plugin_contracts.py) run them on every registered plugin,
and the test that `mmrl new KIND NAME` writes runs them on the new one, so a plugin that passes
its own test passes the repo's too. Each check takes the plugin as a registered name,
`module:attr`, `path/to/file.py:attr` or the object itself, and raises AssertionError naming
what broke.

    check_reward(spec, args, samples)           any response, even empty or huge -> finite scores
    check_tool(spec, sample, args)              schemas, unknown calls are tool errors, state, close
    check_processor(spec, model_dir, samples)   one call -> engine input and trainer input that agree
    check_agent_loop(spec, engine, samples)     trajectories with aligned token fields, reproducible
    local_engine(model_dir, run_dir)            one real vLLM engine in Ray, for check_agent_loop
"""
from __future__ import annotations

import asyncio
import inspect
import json
import math
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Sequence

from mmrl import registry
from mmrl.data.sample import Sample


def contract_samples(n: int = 6, root: str | Path | None = None) -> list[Sample]:
    """`n` held-out samples of the colours recipe, written as a real shard and read back through
    the shard stream (decoding included)."""
    from mmrl.plugins.data.recipes.colors import build
    from mmrl.data.stream import load_all

    with tempfile.TemporaryDirectory(dir=root) as tmp:
        build(tmp, train_size=1, heldout_size=n, shard_size=max(n, 1), seed=0)
        return load_all(str(Path(tmp) / "heldout-000000.tar"))


# ----------------------------------------------------------------------------------- rewards

def check_reward(spec: Any, args: dict[str, Any] | None = None, samples: Sequence[Sample] | None = None) -> None:
    """Finite scores with a "score" key for any response (empty, the answer, junk, 100 kB), called
    alone and as one group the way the reward workers call it."""
    from mmrl.rewards.base import RewardSet, call_reward, reward_kwargs
    from mmrl.rewards.scorer import GroupScorer

    fn, args = registry.resolve("reward", spec), dict(args or {})
    sample = (samples or contract_samples(1))[0]
    responses = ["", "red", str(sample.answer), "@@##!!", "blue " * 20000]
    for response in responses:
        scores = call_reward(fn, **reward_kwargs(sample, response, [1, 2, 3]), **args)
        assert "score" in scores, f"reward {spec!r} returned no 'score' for {response[:40]!r}: {scores}"
        assert all(math.isfinite(v) for v in scores.values()), f"reward {spec!r}: a score is not finite: {scores}"
    group = GroupScorer(RewardSet([{"name": spec if isinstance(spec, str) else fn, "args": args}]),
                        timeout_s=None).score_group(sample, responses, [[1, 2, 3]] * len(responses))
    assert not group["failures"], f"reward {spec!r} failed when scored as a group: {group['failures']}"
    assert all(math.isfinite(v) for s in group["scores"] for v in s.values())


# ------------------------------------------------------------------------------------- tools

def check_tool(spec: Any, sample: Sample | None = None, args: dict[str, Any] | None = None) -> None:
    """Built per trajectory from a sample; OpenAI-style function schemas; a call of an unknown
    function comes back as a tool error (never an exception); state() is plain data; close()
    twice is fine."""
    from mmrl.tools.base import ToolResult, run_tool

    tool = registry.resolve("tool", spec)(sample if sample is not None else contract_samples(1)[0], **(args or {}))
    try:
        functions = tool.functions()
        assert functions, f"tool {spec!r} lists no functions"
        for f in functions:
            assert f.get("type") == "function", f"tool {spec!r}: a schema needs type 'function': {f}"
            assert f["function"].get("name") and f["function"].get("description"), \
                f"tool {spec!r}: every function needs a name and a description: {f}"
            assert f["function"].get("parameters", {}).get("type") == "object", \
                f"tool {spec!r}: parameters must be a JSON schema of type 'object': {f}"
        result, _ = asyncio.run(run_tool(tool, "no_such_function", {}, timeout_s=30))
        assert isinstance(result, ToolResult) and result.error and result.text.startswith("error"), \
            f"tool {spec!r}: a call of an unknown function must come back as a tool error, got {result}"
        json.dumps(tool.state())
    finally:
        tool.close()
        tool.close()


# -------------------------------------------------------------------------------- processors

def check_processor(spec: Any, model_dir: str | Path, samples: Sequence[Sample] | None = None,
                    args: dict[str, Any] | None = None) -> Any:
    """One call per sample gives a ProcessedPrompt whose engine input and trainer input agree:
    the same text tokens, one placeholder per image for the engine, positions for every prompt
    token, the vision placeholders forbidden to sample, declared media limits that accept an
    image right at the limit. Returns the processor (a family's own test checks more)."""
    from PIL import Image

    from mmrl.data.media_limits import MediaLimits
    from mmrl.processors.base import ProcessedPrompt

    proc = registry.resolve("processor", spec)(str(model_dir), **(args or {}))
    sample = (samples or contract_samples(1))[0]
    out = proc(sample)
    assert isinstance(out, ProcessedPrompt), f"processor {spec!r} returned {type(out).__name__}, not ProcessedPrompt"
    assert out.positions_AP.shape[-1] == len(out.prompt_ids), "one position per prompt token"
    assert out.next_position == int(out.positions_AP.max()) + 1, "responses continue after the prompt's positions"
    engine_ids = out.vllm_input["prompt_token_ids"]
    pad = proc.image_token_id
    assert engine_ids.count(pad) == len(sample.images), "the engine gets one placeholder per image"
    assert out.prompt_ids.count(pad) >= len(sample.images), "the trainer's prompt has the expanded placeholders"
    if hasattr(proc, "expand_traced"):  # the exact map from engine tokens to trainer tokens
        expanded, source = proc.expand_traced(out.vllm_input)
        assert expanded.prompt_ids == out.prompt_ids, "expand_traced(engine prompt) must give the trainer's prompt"
        assert source == sorted(source), "the trainer's tokens keep the engine's order"
        for i, tok in enumerate(engine_ids):
            mine = [out.prompt_ids[j] for j, s in enumerate(source) if s == i]
            if tok == pad:
                assert pad in mine, f"engine placeholder {i} expands to no image token"
            else:  # kept as it is, or (a frame token beside a placeholder) part of that block's expansion
                absorbed = not mine and pad in engine_ids[max(i - 1, 0):i + 2]
                assert mine == [tok] or absorbed, f"engine token {i} ({tok}) became {mine}"
    else:  # families that expand the placeholder alone (no frame tokens around it)
        assert [t for t in out.prompt_ids if t != pad] == [t for t in engine_ids if t != pad], \
            "the engine's and the trainer's prompts differ outside the image placeholders"
    assert all(t in proc.forbidden_token_ids for t in (proc.image_token_id, proc.video_token_id) if t is not None), \
        "vision placeholder tokens must be in forbidden_token_ids (the policy must never sample them)"
    assert isinstance(proc.decode(out.prompt_ids[:4]), str)
    limits = proc.media_limits
    assert isinstance(limits, MediaLimits), "media_limits must be a MediaLimits"
    ratio = int(limits.max_aspect_ratio or 4)
    edge = Image.new("RGB", (max(limits.min_side, 1) * ratio, max(limits.min_side, 1)), (90, 30, 200))
    assert limits.image_problem(*edge.size) is None
    assert proc(Sample(key="edge", messages=sample.messages, images=[edge])).mm_inputs, \
        "an image right at the declared media limits must still be processed"
    return proc


# ------------------------------------------------------------------------------- agent loops

@contextmanager
def local_engine(model_dir: str | Path, run_dir: str | Path, max_model_len: int = 512) -> Iterator[dict[str, Any]]:
    """Ray (2 CPUs) and one real vLLM RolloutEngine actor for `model_dir`; yields {"engine",
    "processor", "forbidden"}. For tests and notebooks; runs use the controller's engines."""
    import ray

    from mmrl.processors import build_processor
    from mmrl.rollout.engine import RolloutEngine, cpu_engine_defaults, engine_kwargs
    from mmrl.utils.env import engine_env, init_local_ray, resolve_device

    device = resolve_device("auto")
    env = engine_env(run_dir, device, {"VLLM_LOGGING_LEVEL": "WARNING"})
    init_local_ray(num_cpus=2, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})
    engine = None
    try:
        # chunked prefill off, as the controller sets it on CPU: seeded requests need it
        kwargs = engine_kwargs(str(model_dir), "float32", 0, {"max_model_len": max_model_len,
                                                              "enable_chunked_prefill": False,
                                                              "limit_mm_per_prompt": {"image": 2, "video": 0}})
        if device == "cpu":
            cpu_engine_defaults(kwargs)
        engine = RolloutEngine.as_actor({"num_cpus": 1, "num_gpus": 1 if device == "cuda" else 0}, kwargs, env)
        ray.get(engine.ready.remote(), timeout=600)
        processor = build_processor("auto", str(model_dir))
        yield {"engine": engine, "processor": processor, "forbidden": processor.forbidden_token_ids}
    finally:
        if engine is not None:
            try:
                ray.get(engine.shutdown.remote(), timeout=60)
            except Exception:  # noqa: BLE001 -- killed below either way
                pass
            ray.kill(engine)
        ray.shutdown()


def run_agent_loop(spec: Any, engine: dict[str, Any], samples: Sequence[Sample], n: int,
                   args: dict[str, Any] | None = None, max_new_tokens: int = 4, seed: int = 5) -> tuple[Any, list[int]]:
    """Run `spec` on `samples` (n trajectories each) in one rollout worker on `engine`; returns
    the rollout and the prompt slots in the order their groups arrived. The worker is closed on
    return, and the prompts it put in the object store with it: the trajectories' own fields stay
    readable, their `prompt_ref`s do not (keep a `RolloutWorkers` open to train on a rollout)."""
    from mmrl.controller.rollout import run_rollout
    from mmrl.rollout.types import SamplingConfig
    from mmrl.rollout.workers import RolloutWorkers

    workers = RolloutWorkers(1, [engine["engine"]], {"name": "auto", "model_path": engine["processor"].model_path},
                             spec, args)
    try:
        workers.ready()
        sampling = SamplingConfig(n=n, max_new_tokens=max_new_tokens, forbidden_token_ids=engine["forbidden"], seed=seed)
        arrived: list[int] = []
        rollout = run_rollout(workers, list(samples), sampling, on_group=lambda slot, s, g: arrived.append(slot))
        return rollout, arrived
    finally:
        workers.close()


def check_trajectories(rollout: Any, samples: Sequence[Sample], n: int) -> None:
    """Every group once, in the samples' order, with n trajectories whose per-token fields align;
    sampled tokens carry logprobs <= 0 and weight version 0 (no sync happened)."""
    assert [s.key for s in rollout.samples] == [s.key for s in samples]
    for slot, group in enumerate(rollout.groups):
        assert len(group) == n, f"prompt {slot}: {len(group)} trajectories, expected {n}"
        for t in group:
            assert t.prompt_index == slot
            assert len(t.behaviour_logprobs) == len(t.response_ids) == len(t.loss_mask) == len(t.token_versions), \
                "response_ids, loss_mask, behaviour_logprobs and token_versions must align token by token"
            assert set(t.loss_mask) <= {0, 1} and sum(t.loss_mask) > 0, "some tokens must be the model's (mask 1)"
            sampled = [v for v, m in zip(t.token_versions, t.loss_mask) if m]
            assert sampled and set(sampled) == {0} and t.weight_version == 0
            assert all(lp <= 0 for lp, m in zip(t.behaviour_logprobs, t.loss_mask) if m)
            assert t.timings["engine"] == 0 and t.timings["requests"] >= 1


def check_agent_loop(spec: Any, engine: dict[str, Any], samples: Sequence[Sample] | None = None,
                     args: dict[str, Any] | None = None, n: int = 3) -> Any:
    """An async function called once per trajectory; every group comes back once with aligned
    token fields; seeded trajectories are reproducible. Returns the rollout."""
    loop = registry.resolve("agent_loop", spec)
    assert inspect.iscoroutinefunction(loop), f"agent loop {spec!r} must be an `async def` function"
    assert len(inspect.signature(loop).parameters) >= 3, "an agent loop is called as loop(ctx, sample, prompt)"
    samples = list(samples or contract_samples(4))
    rollout, arrived = run_agent_loop(spec, engine, samples, n, args)
    assert sorted(arrived) == list(range(len(samples)))
    check_trajectories(rollout, samples, n)
    again, _ = run_agent_loop(spec, engine, samples, n, args)
    assert [[t.response_ids for t in g] for g in again.groups] == [[t.response_ids for t in g] for g in rollout.groups], \
        "the same seed gave other trajectories"
    return rollout
