"""A contract test per plugin kind: every registered plugin of the kind (built-in or not) passes it.
The checks themselves live in `mmrl.testing`, which the tests `mmrl new` writes run too.

A new plugin needs nothing here unless it takes required keyword arguments; then add example
arguments to CONTRACT_ARGS (MODEL_ARGS for a reward that needs a locally built model).
"""
from __future__ import annotations

import inspect
from pathlib import Path
from typing import Callable

import pytest
import torch
from PIL import Image

from mmrl import registry
from mmrl.data.sample import Sample
from mmrl.testing import (check_agent_loop, check_processor, check_reward, check_tool, check_trajectories,
                          local_engine, run_agent_loop)

CONTRACT_ARGS: dict[tuple[str, str], dict] = {
    ("reward", "first_word_in"): {"words": ["red", "green"]},
    ("reward", "dapo_overlong"): {"max_length": 4, "cache_length": 2},
}
# Rewards that need a model: the fixture that builds one locally, and the args that name it.
MODEL_ARGS: dict[str, tuple[str, Callable[[Path], dict]]] = {
    "clip_score": ("tiny_clip_dir", lambda d: {"model": str(d)}),
    "vlm_judge": ("tiny_model_dir", lambda d: {"model": str(d), "max_new_tokens": 8,
                                               "engine_args": {"max_model_len": 2048}}),
}
SLOW_REWARDS = {"vlm_judge"}  # starts a vLLM engine in the test process
PLUGINS = Path(__file__).resolve().parent / "_tool_plugins.py"
# Agent loops that need arguments to run at all.
LOOP_ARGS: dict[str, dict] = {"openai_agent": {"agent": f"{Path(__file__).resolve().parent / '_openai_agent.py'}:agent"}}


def _names(kind: str) -> list[str]:
    return [e.name for e in registry.entries(kind) if e.origin == "builtin" or "decorator" in e.origin]


@pytest.fixture(scope="module")
def tiny_clip_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mmrl.models.tiny_clip import build_tiny_clip

    return build_tiny_clip(tmp_path_factory.mktemp("clip") / "tiny-clip")


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_REWARDS else n
                                  for n in _names("reward")])
def test_reward_contract(name: str, colors_samples: list, request: pytest.FixtureRequest) -> None:
    args = CONTRACT_ARGS.get(("reward", name), {})
    if name in MODEL_ARGS:
        fixture, make_args = MODEL_ARGS[name]
        args = {**args, **make_args(request.getfixturevalue(fixture))}
    check_reward(name, args, colors_samples)


# Estimators whose baseline is the batch, not the prompt's group (REINFORCE++): a constant group
# gets one shared, possibly nonzero advantage instead of zero.
BATCH_BASELINE_ADVANTAGES = {"reinforce_pp"}


@pytest.mark.parametrize("name", _names("advantage"))
def test_advantage_contract(name: str) -> None:
    fn = registry.resolve("advantage", name)
    rewards_BG = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.5, 0.5, 0.5], [0.0, 2.0, 1.0, 3.0]])
    adv = fn(rewards_BG)
    assert adv.shape == rewards_BG.shape and torch.isfinite(adv).all()
    if name in BATCH_BASELINE_ADVANTAGES:
        assert torch.allclose(adv[1], adv[1, :1].expand(4)), "no signal within a constant-reward group"
    else:
        assert torch.allclose(adv[1], torch.zeros(4)), "a constant-reward group carries no signal"
    assert torch.allclose(fn(rewards_BG + 7.0), adv, atol=1e-5), "advantages are shift-invariant"
    assert (adv[0, 0] > adv[0, 1]) and (adv[2, 3] > adv[2, 0]), "higher reward, higher advantage"
    # the trainer passes one config dict to whichever estimator is selected
    assert torch.allclose(fn(rewards_BG, norm_by_std=True, eps=1e-6, unknown_option=1), adv)


@pytest.mark.parametrize("name", _names("policy_loss"))
def test_policy_loss_contract(name: str) -> None:
    fn = registry.resolve("policy_loss", name)
    torch.manual_seed(0)
    logprobs_BT = (-torch.rand(3, 5)).requires_grad_()
    old_BT = logprobs_BT.detach() + 0.05 * torch.randn(3, 5)
    mask_BT = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]], dtype=torch.float32)
    loss_BT, stats = fn(logprobs_BT, old_BT, torch.tensor([1.0, -0.5, 2.0]), mask_BT)
    assert loss_BT.shape == (3, 5) and "clipped_BT" in stats and "ratio_BT" in stats
    assert stats["clipped_BT"].dtype == torch.bool and stats["ratio_BT"].shape == (3, 5)
    # the trainer passes one dict: the clip keywords plus options other losses use
    fn(logprobs_BT, old_BT, torch.tensor([1.0, -0.5, 2.0]), mask_BT, clip_low=0.2, clip_high=0.28,
       dual_clip_c=3.0, unknown_option=1)
    assert torch.all(loss_BT[mask_BT == 0] == 0), "masked tokens carry no loss"
    (loss_BT * mask_BT).sum().backward()
    assert torch.isfinite(logprobs_BT.grad).all() and logprobs_BT.grad.abs().sum() > 0


@pytest.mark.parametrize("name", _names("agent_loop"))
def test_agent_loop_signature(name: str) -> None:
    # Called as `await loop(ctx, sample, prompt)` once per trajectory; the real engine run is
    # test_agent_loop_contract below.
    loop = registry.resolve("agent_loop", name)
    assert inspect.iscoroutinefunction(loop), f"agent loop {name!r} must be an async function"
    assert len(inspect.signature(loop).parameters) >= 3


# A two-turn loop from a file, as a user would write one: the model answers, a "tool" line is
# inserted (not trained on), the model answers again on the same engine.
TWO_TURN_LOOP = """
from dataclasses import replace

from mmrl.rollout.agent_loops import make_trajectory


async def two_turn(ctx, sample, prompt):
    first = await ctx.client.generate(prompt.vllm_input, ctx.sampling)
    tool_ids = ctx.processor.tokenizer.encode(ctx.args["tool_text"], add_special_tokens=False)
    second_prompt = dict(prompt.vllm_input)
    second_prompt["prompt_token_ids"] = list(prompt.vllm_input["prompt_token_ids"]) + first.token_ids + tool_ids
    second = await ctx.client.generate(second_prompt, replace(ctx.sampling, seed=None if ctx.sampling.seed is None
                                                                else ctx.sampling.seed + 1))
    return make_trajectory([first, second], between=[(tool_ids, ctx.args["tool_text"])])
"""


@pytest.fixture(scope="module")
def engine_for_loops(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    with local_engine(tiny_model_dir, tmp_path_factory.mktemp("agent_loop_run")) as eng:
        yield eng


@pytest.mark.slow
@pytest.mark.parametrize("name", _names("agent_loop"))
def test_agent_loop_contract(name: str, engine_for_loops: dict, colors_samples: list) -> None:
    """One trajectory per call, `n` calls per sample; every group comes back once, with the
    prompt's slot, aligned per-token fields, versions and the engine it ran on; seeded
    trajectories are reproducible."""
    check_agent_loop(name, engine_for_loops, colors_samples[:5], LOOP_ARGS.get(name), n=3)


@pytest.mark.slow
def test_a_multi_turn_loop_from_a_file(engine_for_loops: dict, colors_samples: list, tmp_path: Path) -> None:
    plugin = tmp_path / "my_loops.py"
    plugin.write_text(TWO_TURN_LOOP)
    samples = colors_samples[:3]
    rollout, _ = run_agent_loop(f"{plugin}:two_turn", engine_for_loops, samples, n=2, args={"tool_text": " tool says: red"})
    check_trajectories(rollout, samples, n=2)
    tool_ids = engine_for_loops["processor"].tokenizer.encode(" tool says: red", add_special_tokens=False)
    for group in rollout.groups:
        for t in group:
            assert t.timings["requests"] == 2
            masked = [tok for tok, m in zip(t.response_ids, t.loss_mask) if not m]
            assert masked == tool_ids and "tool says: red" in t.text
            assert all(lp == 0.0 for lp, m in zip(t.behaviour_logprobs, t.loss_mask) if not m)


# The model folder each adapter is checked on (a fixture that builds it locally).
PROCESSOR_MODELS = {"llava": "tiny_llava_dir", "internvl": "tiny_internvl_dir"}


@pytest.mark.parametrize("name", _names("processor"))
def test_processor_contract(name: str, colors_samples: list, request: pytest.FixtureRequest) -> None:
    proc = check_processor(name, request.getfixturevalue(PROCESSOR_MODELS.get(name, "tiny_model_dir")), colors_samples)
    if name == "qwen_vl":  # Qwen-VL: three M-RoPE axes, 2x2 patches merged into one token
        out = proc(colors_samples[0])
        assert out.positions_AP.shape == (3, len(out.prompt_ids))
        grid = out.mm_inputs["image_grid_thw"]
        assert out.prompt_ids.count(proc.image_token_id) == int(grid.prod(-1).sum()) // 4
    if name == "llava":  # one token per CLIP patch, plain positions, the engine's prompt rebuilt exactly
        out = proc(colors_samples[0])
        assert out.prompt_ids.count(proc.image_token_id) == 16 and out.positions_AP.shape == (1, len(out.prompt_ids))
        assert proc.expand(out.vllm_input).prompt_ids == out.prompt_ids
    if name == "internvl":  # a 56-px image is one tile of 4 tokens, framed by <img> ... </img>
        out = proc(colors_samples[0])
        start, end = (proc.tokenizer.convert_tokens_to_ids(t) for t in ("<img>", "</img>"))
        i = out.prompt_ids.index(start)
        assert out.prompt_ids[i:i + 6] == [start] + [proc.image_token_id] * 4 + [end]
        assert out.positions_AP.shape == (1, len(out.prompt_ids)) and list(out.mm_inputs) == ["pixel_values"]
        assert {start, end, proc.image_token_id} <= set(proc.forbidden_token_ids)


@pytest.mark.parametrize("name", _names("dataset"))
def test_dataset_contract(name: str, tmp_path: Path) -> None:
    from mmrl.data.stream import load_all

    info = registry.resolve("dataset", name)(tmp_path, train_size=12, heldout_size=6, shard_size=8)
    assert info["counts"] == {"train": 12, "heldout": 6}
    heldout = load_all(str(tmp_path / info["shards"]["heldout"]))
    assert len(heldout) == 6 and all(s.messages and s.answer is not None for s in heldout)


# ----------------------------------------------------------------------------------- tools

def _tool_sample(tmp_path: Path) -> Sample:
    """A sample that carries what every built-in tool reads: an image (image_zoom), a GUI spec
    (gui) and a corpus (search)."""
    from mmrl.tools.gui import DesktopSpec
    from mmrl.tools.search import write_corpus

    write_corpus(tmp_path / "corpus.jsonl", seed=0, n_docs=20)
    return Sample(key="tool-sample", messages=[{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "q"}]}],
                  images=[Image.new("RGB", (64, 48), "red")],
                  metadata={"gui": DesktopSpec.generate(0).to_dict(), "corpus": str(tmp_path / "corpus.jsonl")})


@pytest.mark.parametrize("name", _names("tool"))
def test_tool_contract(name: str, tmp_path: Path) -> None:
    check_tool(name, _tool_sample(tmp_path))


@pytest.mark.parametrize("name", _names("tool_parser"))
def test_tool_parser_contract(name: str) -> None:
    """No call in plain text; a call of an unknown function comes back with an error, not dropped."""
    from mmrl.tools.parsers import ToolCall
    from mmrl.tools.zoom import ImageZoom

    parse = registry.resolve("tool_parser", name)
    functions = ImageZoom().functions()
    assert parse("the answer is red", functions) == []
    calls = parse('<tool_call>{"name": "nope", "arguments": {}}</tool_call><tool_call>nope 1</tool_call>', functions)
    assert calls and all(isinstance(c, ToolCall) and c.error for c in calls), calls


@pytest.mark.slow
def test_multi_turn_tokens_are_the_engines_tokens(engine_for_loops: dict, colors_samples: list) -> None:
    """Three model turns with two tool turns between them: the trajectory is exactly the engine's
    completions and the tool turns' own tokens, in order, although decoding the transcript and
    encoding it again gives other tokens (the drift a re-tokenising loop would train on)."""
    processor = engine_for_loops["processor"]
    tok = processor.tokenizer
    args = {"parser": f"{PLUGINS}:every_function", "max_turns": 3, "tools": [{"name": f"{PLUGINS}:Echo"}]}
    rollout, _ = run_agent_loop(f"{PLUGINS}:recording_multi_turn", engine_for_loops, colors_samples[:4], n=2, args=args)
    check_trajectories(rollout, colors_samples[:4], n=2)
    drifted = 0
    for group in rollout.groups:
        for t in group:
            completions = t.tool_state["engine_completions"]
            assert len(completions) == 3 and t.stats["turns"] == 3 and t.stats["tool_calls"] == 2
            runs, current, flags = [], [], []
            for token, m in zip(t.response_ids, t.loss_mask):
                if flags and m != flags[-1]:
                    runs.append((flags[-1], current))
                    current = []
                flags.append(m)
                current.append(token)
            runs.append((flags[-1], current))
            assert [ids for m, ids in runs if m] == completions
            for m, ids in runs:
                if not m:  # a tool turn: (end of turn if missing) + the rendered tool message
                    assert "tool says: red" in tok.decode(ids)
            text = tok.decode(t.response_ids, skip_special_tokens=False)
            drifted += tok(text, add_special_tokens=False)["input_ids"] != t.response_ids
    assert drifted > 0, "no transcript re-tokenised differently: the test shows nothing (pick another seed)"


@pytest.mark.slow
def test_a_tool_that_raises_refuses_or_hangs_is_a_tool_error(engine_for_loops: dict, colors_samples: list) -> None:
    args = {"parser": f"{PLUGINS}:every_function", "max_turns": 2, "tool_timeout_s": 3.0,
            "tools": [{"name": f"{PLUGINS}:Raises"}, {"name": f"{PLUGINS}:Refuses"}, {"name": f"{PLUGINS}:Hangs"}]}
    rollout, _ = run_agent_loop("multi_turn", engine_for_loops, colors_samples[:2], n=2, args=args)
    check_trajectories(rollout, colors_samples[:2], n=2)
    for t in (t for g in rollout.groups for t in g):
        assert t.stats["tool_calls"] == 3 and t.stats["tool_errors"] == 3 and t.stats["turns"] == 2
        answers = {turn["name"]: turn["content"] for turn in t.transcript if turn["role"] == "tool"}
        assert "RuntimeError: the tool's own bug" in answers["raises"]
        assert answers["refuses"] == "error: x is required"
        assert "timed out after 3.0 s" in answers["hangs"]
