"""The tiny Qwen3-VL-MoE (4 experts, top-2, every text layer sparse) end to end on the real parts:
the vLLM CPU engine records the experts it routed every sampled token to, the 2-rank ZeRO-3
trainer replays them (algorithm.routing_replay=rollout), the demo's GRPO steps run with weight
syncs (the fused experts go to vLLM in its layout), and the export loads again.

Measured here and printed: engine-vs-trainer |logprob diff| with and without replay, and the
router agreement (share of (sampled token, MoE layer) pairs where the trainer's own top-2 is the
engine's)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import ray
from _engine import demo_runtime, demo_steps

from mmrl.controller.checkpoint import save_checkpoint
from mmrl.controller.rollout import run_rollout
from mmrl.models.tiny_vlm import MOE_EXPERTS, MOE_TOP_K, build_tiny_vlm
from mmrl.rollout.types import SamplingConfig
from mmrl.trainer.batch import TrainSequence
from mmrl.trainer.plan import plan_forward_only

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_vlm("qwen3_vl_moe", tmp_path_factory.mktemp("moe") / "tiny-qwen3-vl-moe", seed=0)


@pytest.fixture(scope="module")
def runtime(moe_dir: Path, colors_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    with demo_runtime(moe_dir, colors_dir, tmp_path_factory.mktemp("moe_run"), "algorithm.routing_replay=rollout",
                      "rollout.max_new_tokens=8") as rt:
        yield rt


def _trainer_logprobs(rt, seqs: list[TrainSequence]) -> list[np.ndarray]:
    chunks, order = plan_forward_only(seqs, world_size=len(rt.trainers), micro_batch_size=8)
    per_rank = ray.get([tr.compute_logprobs.remote(c) for tr, c in zip(rt.trainers, chunks)])
    lps = {i: lp for idx, rank in zip(order, per_rank) for i, lp in zip(idx, rank)}
    return [np.asarray(lps[i]) for i in range(len(seqs))]


def test_routing_is_recorded_and_replay_gives_parity(runtime, colors_samples: list) -> None:
    rt = runtime
    sampling = SamplingConfig(n=4, max_new_tokens=8, temperature=1.0, forbidden_token_ids=rt.sampling.forbidden_token_ids,
                              seed=3)
    rollout = run_rollout(rt.workers, colors_samples[:6], sampling)
    trajectories = [(i, t) for i, g in enumerate(rollout.groups) for t in g]
    for _, t in trajectories:  # every sampled token, every MoE layer, top-2 distinct experts
        r = t.routed_experts
        assert r is not None and r.shape == (len(t.response_ids), 2, MOE_TOP_K), None if r is None else r.shape
        assert r.min() >= 0 and r.max() < MOE_EXPERTS and (r[..., 0] != r[..., 1]).all()
    behaviour = [np.asarray(t.behaviour_logprobs) for _, t in trajectories]

    def log_ratios(replay: bool) -> np.ndarray:
        """trainer - engine logprob of every sampled token: log of the importance ratio pi/mu."""
        seqs = [TrainSequence.from_prompt(rollout.prompts[i], t.response_ids, t.behaviour_logprobs, t.loss_mask,
                                          routed_experts=t.routed_experts if replay else None) for i, t in trajectories]
        return np.concatenate([lp - b for lp, b in zip(_trainer_logprobs(rt, seqs), behaviour)])

    on, off = log_ratios(True), log_ratios(False)
    with_r3, without = np.abs(on), np.abs(off)
    print(f"\nMoE parity |d logprob| over {on.size} tokens: with R3 mean {with_r3.mean():.2e} max {with_r3.max():.2e}, "
          f"ratio [{np.exp(on.min()):.6f}, {np.exp(on.max()):.6f}]; without R3 mean {without.mean():.2e} max "
          f"{without.max():.2e}, ratio [{np.exp(off.min()):.6f}, {np.exp(off.max()):.6f}]")
    assert with_r3.size >= 6 * 4
    assert with_r3.mean() <= 1e-4 and with_r3.max() <= 1e-3, (with_r3.mean(), with_r3.max())


def test_demo_steps_train_sync_and_measure_router_agreement(runtime, colors_dir: Path) -> None:
    """Two of the demo's GRPO steps with replay: each step syncs the weights (the experts reach
    vLLM transposed to its layout), so the next step's parity shows the sync is exact."""
    rt = runtime
    for step, metrics, used in demo_steps(rt, colors_dir, 2):
        assert metrics["weight_version"] == step and metrics["train/nonfinite_skipped"] == 0
        print(f"step {step}: mean |d| {metrics['mismatch/mean_abs_logprob_diff']:.2e}, router agreement "
              f"{metrics['mismatch/router_agreement']:.4f}, ratio [{metrics['mismatch/ratio_min']:.6f}, "
              f"{metrics['mismatch/ratio_max']:.6f}]")
        assert metrics["mismatch/mean_abs_logprob_diff"] < 1e-4
        assert 0.9 <= metrics["mismatch/router_agreement"] <= 1.0


def test_export_loads_in_transformers_with_the_experts_in_the_released_layout(runtime, tmp_path: Path) -> None:
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForImageTextToText

    from mmrl.trainer.export import export_checkpoint

    rt = runtime
    ckpt = save_checkpoint(tmp_path / "run", 1, rt.trainers, {"step": 1}, model_path=rt.cfg.model.path)
    out = export_checkpoint(ckpt, tmp_path / "export")
    model = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32)
    text = model.config.text_config
    with safe_open(str(next(out.glob("model*.safetensors"))), "pt") as f:
        shape = f.get_slice("model.language_model.layers.0.mlp.experts.gate_up_proj").get_shape()
    assert shape == [MOE_EXPERTS, text.hidden_size, 2 * text.moe_intermediate_size], shape
    # the export equals the trainer's weights (what the engine was synced with)
    state = ray.get([t.full_state_dict.remote() for t in rt.trainers])[0]
    name = "model.language_model.layers.0.mlp.experts.down_proj"
    assert torch.equal(model.state_dict()[name], state[name])
