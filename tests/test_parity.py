"""Logprob parity: the real vLLM engine (Ray actor) vs the real ZeRO-3 trainer (2 ranks, gloo),
fp32, image prompts, at the same weights: before a weight sync, and after a training step and a
sync. The control (engine still on the old weights, trainer on the new) must differ widely, which
shows the sync really changed what the engine computes."""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import ray
import torch

from _engine import demo_runtime

from mmrl.controller.learn import make_sequences
from mmrl.controller.loop import Runtime
from mmrl.controller.rollout import run_rollout
from mmrl.rollout.types import SamplingConfig
from mmrl.trainer.batch import TrainSequence
from mmrl.trainer.plan import MiniBatch, StepInputs, plan_forward_only, plan_updates

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runtime(tiny_model_dir: Path, colors_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    with demo_runtime(tiny_model_dir, colors_dir, tmp_path_factory.mktemp("parity_run"),
                      "trainer.lr=0.02", "rollout.max_new_tokens=8",
                      # room for an image a tool returns in a later turn (the multi-turn test)
                      "rollout.engine_args.limit_mm_per_prompt={image: 2, video: 0}",
                      # a pixel budget below the model's own: both sides must resize large images to it
                      "processor.max_pixels=12544") as rt:
        yield rt


def _engine_logs() -> str:
    """What the actors and their vLLM processes have written so far (Ray's per-worker log files)."""
    logs = Path(ray._private.worker._global_node.get_logs_dir_path())
    return "".join(p.read_text(errors="replace") for p in sorted(logs.glob("worker-*")) if p.suffix in (".out", ".err"))


def _rollout_and_compare(rt: Runtime, samples: list) -> tuple[list, list, np.ndarray]:
    sampling = SamplingConfig(n=4, max_new_tokens=8, temperature=1.0, forbidden_token_ids=rt.sampling.forbidden_token_ids)
    rollout = run_rollout(rt.workers, samples, sampling)  # the rollout workers and single_turn, as in training
    prompts, groups = rollout.prompts, rollout.groups
    seqs = [TrainSequence.from_prompt(prompts[i], t.response_ids, t.behaviour_logprobs, t.loss_mask)
            for i, g in enumerate(groups) for t in g]
    chunks, order = plan_forward_only(seqs, world_size=len(rt.trainers), micro_batch_size=8)
    per_rank = ray.get([tr.compute_logprobs.remote(c) for tr, c in zip(rt.trainers, chunks)])
    trainer_lps = {i: lp for idx, rank in zip(order, per_rank) for i, lp in zip(idx, rank)}
    diffs = np.concatenate([np.abs(np.asarray(trainer_lps[i]) - np.asarray(s.behaviour_logprobs))
                            for i, s in enumerate(seqs)])
    assert all(t.weight_version == rt.weight_version for g in groups for t in g)
    assert all(set(t.token_versions) == {rt.weight_version} for g in groups for t in g)
    return prompts, groups, diffs


def test_logprob_parity_before_and_after_weight_sync(runtime: Runtime, colors_samples: list) -> None:
    rt = runtime
    samples = colors_samples[:8]
    prompts, groups, before = _rollout_and_compare(rt, samples)
    assert all("pixel_values" in ray.get(p.ref).mm_inputs for p in prompts)  # image prompts, sent by reference
    assert before.size >= 8 * 4 and before.mean() <= 1e-4, before.mean()

    # one real training step with random advantages moves the trainer's weights
    advantages_BG = torch.randn(len(groups), 4, generator=torch.Generator().manual_seed(0))
    seqs = make_sequences(prompts, groups)
    for seq, adv in zip(seqs, advantages_BG.flatten().tolist()):
        seq.advantage = adv
    inputs = plan_updates(seqs, world_size=len(rt.trainers), micro_batch_size=64)
    stats = ray.get([t.train_step.remote(x) for t, x in zip(rt.trainers, inputs)])
    assert stats[0]["grad_norms"][0] > 0 and stats[0]["skipped_updates"] == 0

    _, _, control = _rollout_and_compare(rt, samples)  # engine: old weights; trainer: new
    assert control.mean() > 1e-2, control.mean()

    checksum_old = ray.get(rt.engines[0].weights_checksum.remote())
    rt.weight_version += 1
    sync = ray.get([t.sync_weights.remote(rt.engines, rt.weight_version, 0.5) for t in rt.trainers])
    assert sync[0]["buckets"] > 1, "small buckets: the model is gathered and sent in pieces"
    assert ray.get(rt.engines[0].weights_checksum.remote()) != checksum_old
    assert ray.get(rt.engines[0].get_weight_version.remote()) == rt.weight_version

    _, _, after = _rollout_and_compare(rt, samples)
    assert after.mean() <= 1e-4, after.mean()
    # The reload warns "<Class>: Failed to load weights" for modules that hold no checkpoint
    # weights (rotary tables, image normalisation); the engine's processes drop exactly those
    # (mmrl/rollout/vllm_logs.py), and the parity above shows the modules still compute right.
    assert "Failed to load weights" not in _engine_logs()
    print(f"parity mean|d|: before {before.mean():.2e}, control {control.mean():.2e}, after {after.mean():.2e}")


def train_with_a_text_only_rank(rt: Runtime, colors_samples: list) -> None:
    """Rank 0 gets image prompts, rank 1 text-only ones: rank 1 must still run the vision tower
    (zero-weighted, the adapter's dummy input) or the ZeRO-3 parameter gathers on rank 0 wait forever."""
    from mmrl.data.sample import Sample, messages_from_prompt

    image_prompts = [rt.processor(s) for s in colors_samples[:2]]
    text_prompts = [rt.processor(Sample(key=f"t{i}", messages=messages_from_prompt(f"Name colour number {i}.")))
                    for i in range(2)]
    assert not text_prompts[0].mm_inputs
    shards = [[TrainSequence.from_prompt(p, [11, 12], [-1.0, -1.0], [1, 1], advantage=1.0) for p in prompts]
              for prompts in (image_prompts, text_prompts)]
    logprobs = ray.get([tr.compute_logprobs.remote([s]) for tr, s in zip(rt.trainers, shards)], timeout=240)
    assert [len(x) for x in logprobs] == [2, 2]
    stats = ray.get([tr.train_step.remote(StepInputs([MiniBatch([s], 8.0)])) for tr, s in zip(rt.trainers, shards)],
                    timeout=240)
    assert all(np.isfinite(s["grad_norms"][0]) for s in stats)


@pytest.mark.timeout(300)
def test_text_only_micro_batch_on_one_rank_does_not_hang(runtime: Runtime, colors_samples: list) -> None:
    train_with_a_text_only_rank(runtime, colors_samples)


@pytest.mark.timeout(300)
def test_nonfinite_loss_skips_the_update_and_training_goes_on(runtime: Runtime, colors_samples: list) -> None:
    """A nan advantage makes the loss and every gradient nan: DeepSpeed's step sees a non-finite
    norm and skips the update; the weights stay exactly as they were and the next step trains."""
    rt = runtime
    prompts = [rt.processor(s) for s in colors_samples[:2]]

    def step(advantage: float) -> list[dict]:
        seqs = [TrainSequence.from_prompt(p, [11, 12], [-1.0, -1.0], [1, 1], advantage=advantage) for p in prompts]
        inputs = plan_updates(seqs, world_size=len(rt.trainers), micro_batch_size=8)
        return ray.get([t.train_step.remote(x) for t, x in zip(rt.trainers, inputs)], timeout=240)

    before = ray.get([t.full_state_dict.remote() for t in rt.trainers])[0]
    stats = step(float("nan"))
    assert stats[0]["skipped_updates"] == 1 and not np.isfinite(stats[0]["grad_norms"][0])
    after = ray.get([t.full_state_dict.remote() for t in rt.trainers])[0]
    assert all(torch.equal(before[k], after[k]) for k in before)
    stats = step(1.0)
    assert stats[0]["skipped_updates"] == 0 and np.isfinite(stats[0]["grad_norms"][0])
    moved = ray.get([t.full_state_dict.remote() for t in rt.trainers])[0]
    assert any(not torch.equal(before[k], moved[k]) for k in before)


def test_multi_turn_parity_with_an_image_returned_by_a_tool(runtime: Runtime, colors_samples: list) -> None:
    """Turn 1, then a tool turn that shows a zoomed crop (a new image), then turn 2: engine
    logprobs against the trainer's over every model token of both turns, fp32. Needs the crop's
    vision block expanded at the right place, M-RoPE positions that continue across it, the
    crop's pixels in the trainer's batch, and a loss mask that covers only the model's tokens."""
    rt = runtime
    args = {"parser": f"{REPO}/tests/_tool_plugins.py:zoom_every_turn", "max_turns": 2,
            "tools": [{"name": "image_zoom", "args": {"upscale_to": 56}}]}
    with _rollout_with(rt, "multi_turn", args, colors_samples[:4], max_new_tokens=4, seed=3) as rollout:
        image_pad = rt.processor.image_token_id
        seqs = make_sequences(rollout.prompts, rollout.groups)
        for t, seq in zip([t for g in rollout.groups for t in g], seqs):
            assert t.stats["turns"] == 2 and t.stats["tool_calls"] == 1 and t.stats["tool_images"] == 1
            assert t.transcript[1]["role"] == "tool" and t.transcript[1]["images"] == 1
            assert t.response_inputs is not None
            mask = np.asarray(t.loss_mask)
            ids = np.asarray(t.response_ids)
            # the 56x56 crop is a 4x4 patch grid merged 2x2: 4 vision tokens, none of them trained on
            assert (ids == image_pad).sum() == 4 and not mask[ids == image_pad].any()
            # model tokens: turn 1 first, turn 2 last, the tool turn (mask 0) between them
            assert mask[:4].all() and mask[-4:].all() and mask.sum() == 8
            assert all(v == rt.weight_version for v, m in zip(t.token_versions, t.loss_mask) if m)
        diffs = _model_token_diffs(rt, seqs)
        assert diffs.size == 8 * len(seqs) and diffs.mean() <= 1e-4, diffs.mean()
        print(f"multi-turn parity mean|d| {diffs.mean():.2e} over {diffs.size} model tokens")


def test_an_openai_client_agent_is_trained_through_the_proxy(runtime: Runtime, colors_samples: list) -> None:
    """tests/_openai_agent.py imports only `openai`: two turns with a tool result between them,
    its own system prompt. Through the proxy its trajectories carry the engine's token ids,
    logprobs and weight versions, the re-rendered history is spliced back onto the recorded
    tokens (drift counted), the trainer's logprobs match the engine's and a training step runs."""
    rt = runtime
    with _rollout_with(rt, "openai_agent", {"agent": f"{REPO}/tests/_openai_agent.py:agent"},
                       colors_samples[:4], max_new_tokens=8, seed=4) as rollout:
        trajectories = [t for g in rollout.groups for t in g]
        for t in trajectories:
            assert t.stats["proxy_calls"] == 2 and t.prompt_ref is not None  # its own system prompt
            mask = np.asarray(t.loss_mask)
            # two model turns: two runs of sampled tokens, the tool turn and template (mask 0) between them
            assert mask[0] == 1 and np.count_nonzero(np.diff(mask) == 1) == 1 and (mask == 0).any()
            assert t.tool_state["answer"] is not None and len(t.transcript) == 2
            assert all(v == rt.weight_version for v, m in zip(t.token_versions, t.loss_mask) if m)
            assert all(lp < 0 for lp, m in zip(t.behaviour_logprobs, t.loss_mask) if m)
        assert sum(t.stats["drift"] for t in trajectories) >= 1
        assert sum(t.stats["drift_spliced"] for t in trajectories) == sum(t.stats["drift"] for t in trajectories)
        seqs = make_sequences(rollout.prompts, rollout.groups)
        diffs = _model_token_diffs(rt, seqs)
        assert diffs.mean() <= 1e-4, diffs.mean()
        for seq, adv in zip(seqs, [1.0, -1.0] * len(seqs)):
            seq.advantage = adv
        stats = ray.get([t.train_step.remote(x) for t, x in
                         zip(rt.trainers, plan_updates(seqs, world_size=len(rt.trainers), micro_batch_size=64))])
        assert stats[0]["grad_norms"][0] > 0 and stats[0]["skipped_updates"] == 0
        print(f"openai agent: parity mean|d| {diffs.mean():.2e} over {diffs.size} tokens; drift "
              f"{sum(t.stats['drift'] for t in trajectories):.0f} of {len(trajectories) * 2} calls, all spliced")


@contextmanager
def _rollout_with(rt: Runtime, loop: str, args: dict, samples: list, *, max_new_tokens: int, seed: int):
    """Two trajectories per sample with agent loop `loop` in a rollout worker of its own, on the
    module's engine. The worker owns the prompts it put in the object store, so it stays up until
    the caller is done with them: a killed owner takes its objects with it (OwnerDiedError)."""
    from mmrl.rollout.workers import RolloutWorkers

    rt.push_weights()  # earlier tests of the module may have trained without a sync
    spec = {"name": rt.cfg.processor.name, "model_path": rt.cfg.model.path, "min_pixels": rt.cfg.processor.min_pixels,
            "max_pixels": rt.cfg.processor.max_pixels, "max_prompt_tokens": rt.cfg.processor.max_prompt_tokens}
    workers = RolloutWorkers(1, rt.engines, spec, loop, args)
    try:
        workers.ready()
        sampling = SamplingConfig(n=2, max_new_tokens=max_new_tokens, temperature=1.0, seed=seed,
                                  forbidden_token_ids=rt.sampling.forbidden_token_ids)
        yield run_rollout(workers, samples, sampling)
    finally:
        workers.close()


def _model_token_diffs(rt: Runtime, seqs: list) -> np.ndarray:
    """|trainer logprob - engine logprob| over the tokens the model sampled (loss mask 1)."""
    chunks, order = plan_forward_only(seqs, world_size=len(rt.trainers), micro_batch_size=8)
    per_rank = ray.get([tr.compute_logprobs.remote(c) for tr, c in zip(rt.trainers, chunks)])
    trainer_lps = {i: lp for idx, rank in zip(order, per_rank) for i, lp in zip(idx, rank)}
    return np.concatenate([np.abs(np.asarray(trainer_lps[i]) - np.asarray(s.behaviour_logprobs))[np.asarray(s.loss_mask) == 1]
                           for i, s in enumerate(seqs)])


def test_parity_on_images_above_the_processor_pixel_budget(runtime: Runtime, colors_samples: list) -> None:
    """processor.max_pixels reaches the engine's processor too: a 448x448 image is resized to the
    same 112x112 on both sides (the model's own budget would give the engine 4x the vision
    tokens, and the trainer's logprobs would not even line up)."""
    from mmrl.data.sample import Sample

    rt = runtime
    rt.push_weights()
    big = [Sample(key=f"big-{i}", messages=s.messages, images=[s.images[0].resize((448, 448))], answer=s.answer)
           for i, s in enumerate(colors_samples[:4])]
    with _rollout_with(rt, "single_turn", {}, big, max_new_tokens=4, seed=5) as rollout:
        prompt = ray.get(rollout.prompts[0].ref)
        assert prompt.mm_inputs["image_grid_thw"].tolist() == [[1, 8, 8]]  # 112 / 14 patches a side
        diffs = _model_token_diffs(rt, make_sequences(rollout.prompts, rollout.groups))
        assert diffs.size == 4 * 2 * 4 and diffs.mean() <= 1e-4, diffs.mean()
