"""The families beyond Qwen end to end on the real parts: a tiny random model of each, the vLLM
engine and the 2-rank ZeRO-3 trainer.

  * LLaVA: CLIP tower, 1-D positions, `<image>` expanded to 16 tokens; the sync renames the
    CLIP tower's weights for vLLM through the adapter.
  * InternVL: InternViT tower, 1-D positions, each image tiled (up to 4 tiles of 56 px, 4 tokens
    each) between `<img>` and `</img>`; weights named alike on both sides.

Per family, on one runtime at the colours demo's settings: the demo learns (its first test, on the
fresh random weights; `learning` marker, `make test-learning`), three GRPO steps with exact
engine/trainer agreement (in CI), logprob parity before and after a weight sync (one image and two images per
prompt), and a text-only micro-batch on one rank (the adapter's dummy vision input)."""
from __future__ import annotations

from pathlib import Path

import pytest
import ray
import torch
from _engine import demo_runtime, demo_steps
from test_parity import _rollout_and_compare, train_with_a_text_only_rank

from mmrl import registry
from mmrl.controller.learn import make_sequences
from mmrl.controller.loop import evaluate, run_step
from mmrl.controller.prompts import SampleBatches
from mmrl.data.sample import Sample, messages_from_prompt
from mmrl.data.stream import ShardStream
from mmrl.models.tiny_vlm import build_tiny_vlm
from mmrl.trainer.plan import plan_updates
from mmrl.utils.timing import StepSpans

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["llava", "internvl"])
def runtime(request: pytest.FixtureRequest, colors_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    family = request.param
    model = build_tiny_vlm(family, tmp_path_factory.mktemp(family) / f"tiny-{family}", seed=0)
    with demo_runtime(model, colors_dir, tmp_path_factory.mktemp(f"{family}_run"),
                      "rollout.engine_args.limit_mm_per_prompt={image: 2, video: 0}") as rt:
        yield rt


@pytest.mark.learning  # ~10 min per family on 2 cores; CI runs the short steps below
@pytest.mark.timeout(3000)  # a busy machine can triple the run; the bound is for hangs only
def test_the_colours_demo_learns(runtime, colors_dir: Path, colors_samples: list) -> None:
    """The demo's GRPO steps (its config: 16 prompts x 16 samples, lr 5e-4, entropy bonus 0.1) from
    random weights until held-out greedy accuracy reaches 0.6 (chance: 1/6). The benchmark
    (`benchmarks/colors_learning.py --arch FAMILY`) runs the whole CLI to 0.95."""
    rt = runtime
    assert rt.weight_version == 0, "the first test of the family: the weights are the random ones"
    stream = ShardStream(f"{colors_dir}/train-000000.tar", shuffle_buffer=rt.cfg.data.shuffle_buffer, seed=0)
    batches = SampleBatches(stream, rt.cfg.rollout.prompts_per_step)
    advantage = registry.resolve("advantage", rt.cfg.algorithm.advantage)
    curve = [(0, evaluate(rt, colors_samples)["eval/heldout_accuracy"])]
    rewards = []
    for step in range(1, 201):
        metrics, used = run_step(rt, batches(), advantage, StepSpans(), step=step, batches=batches)
        assert len(used) == rt.cfg.rollout.prompts_per_step and metrics["weight_version"] == step
        # the engine samples what the trainer computes, every step: the family's sync is exact
        assert metrics["mismatch/mean_abs_logprob_diff"] < 1e-4
        rewards.append(metrics["reward/mean"])
        if step % 5 == 0:
            curve.append((step, evaluate(rt, colors_samples)["eval/heldout_accuracy"]))
            if curve[-1][1] >= 0.6:
                break
    print(f"{rt.cfg.model.path}: held-out accuracy by step {curve}")
    assert curve[0][1] <= 0.35, f"an untrained random model should be near chance, got {curve[0][1]}"
    assert curve[-1][1] >= 0.6, f"held-out accuracy never reached 0.6 in 200 steps: {curve}"
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.1, rewards  # sampled at temperature 1: below greedy


def test_grpo_steps_train_and_the_engine_samples_what_the_trainer_computes(runtime, colors_dir: Path) -> None:
    """Three of the demo's GRPO steps: every prompt used, the weights pushed each step, and the
    engine's logprobs equal to the trainer's under the new weights (the family's sync is exact)."""
    rt = runtime
    for step, metrics, used in demo_steps(rt, colors_dir, 3):
        assert len(used) == rt.cfg.rollout.prompts_per_step and metrics["weight_version"] == step
        assert metrics["mismatch/mean_abs_logprob_diff"] < 1e-4
        assert torch.isfinite(torch.tensor(metrics["loss/pg"])) and metrics["train/nonfinite_skipped"] == 0, metrics


def test_parity_before_and_after_weight_sync(runtime, colors_samples: list) -> None:
    rt = runtime
    a, b = colors_samples[0].images[0], colors_samples[1].images[0]
    samples = colors_samples[:6] + [Sample(key="two", messages=messages_from_prompt("Same colour?", n_images=2),
                                           images=[a, b])]
    prompts, groups, before = _rollout_and_compare(rt, samples)
    mm = ray.get(prompts[-1].ref)
    # 1-D positions; two 56-px images: one CLIP input or one InternVL tile each
    assert mm.positions_AP.shape[0] == 1 and mm.mm_inputs["pixel_values"].shape[0] == 2
    assert before.mean() <= 1e-4, before.mean()

    seqs = make_sequences(prompts, groups)
    for seq, adv in zip(seqs, torch.randn(len(seqs), generator=torch.Generator().manual_seed(0)).tolist()):
        seq.advantage = adv
    ray.get([t.set_lr.remote(0.02) for t in rt.trainers])  # one step that visibly moves the weights
    stats = ray.get([t.train_step.remote(x) for t, x in
                     zip(rt.trainers, plan_updates(seqs, world_size=len(rt.trainers), micro_batch_size=64))])
    assert stats[0]["skipped_updates"] == 0
    _, _, control = _rollout_and_compare(rt, samples)
    assert control.mean() > 1e-2, control.mean()
    rt.weight_version += 1
    ray.get([t.sync_weights.remote(rt.engines, rt.weight_version, 0.5) for t in rt.trainers])
    _, _, after = _rollout_and_compare(rt, samples)
    assert after.mean() <= 1e-4, after.mean()
    print(f"{rt.cfg.model.path} parity mean|d|: before {before.mean():.2e}, control {control.mean():.2e}, after {after.mean():.2e}")


@pytest.mark.timeout(300)
def test_text_only_micro_batch_on_one_rank(runtime, colors_samples: list) -> None:
    train_with_a_text_only_rank(runtime, colors_samples)
