"""The families beyond Qwen end to end on the real parts: a tiny random model of each, the vLLM
engine and the 2-rank ZeRO-3 trainer.

  * LLaVA: CLIP tower, 1-D positions, `<image>` expanded to 16 tokens; the sync renames the
    CLIP tower's weights for vLLM through the adapter.
  * InternVL: InternViT tower, 1-D positions, each image tiled (up to 4 tiles of 56 px, 4 tokens
    each) between `<img>` and `</img>`; weights named alike on both sides.

Per family: logprob parity before and after a weight sync (one image and two images per prompt),
and a text-only micro-batch on one rank (the adapter's dummy vision input)."""
from __future__ import annotations

from pathlib import Path

import pytest
import ray
import torch
from _engine import demo_runtime
from test_parity import _rollout_and_compare, train_with_a_text_only_rank

from mmrl.controller.learn import make_sequences
from mmrl.data.sample import Sample, messages_from_prompt
from mmrl.models.tiny_vlm import build_tiny_vlm
from mmrl.trainer.plan import plan_updates

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", params=["llava", "internvl"])
def runtime(request: pytest.FixtureRequest, colors_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    family = request.param
    model = build_tiny_vlm(family, tmp_path_factory.mktemp(family) / f"tiny-{family}", seed=0)
    with demo_runtime(model, colors_dir, tmp_path_factory.mktemp(f"{family}_run"), "trainer.lr=0.02",
                      "rollout.max_new_tokens=8", "rollout.engine_args.limit_mm_per_prompt={image: 2, video: 0}") as rt:
        yield rt


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
