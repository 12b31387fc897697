"""LoRA through peft on the real 2-rank ZeRO-3 trainer: only the adapters train, the rollout
engine receives merged weights (logprob parity with vLLM after a step + sync), the reference
policy for the KL is the base model (adapters off), and a checkpoint exports merged."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import ray
import torch

from _engine import demo_runtime

from mmrl.controller.learn import logprob_pass, make_sequences
from mmrl.controller.loop import Runtime
from mmrl.controller.rollout import run_rollout
from mmrl.rollout.types import SamplingConfig
from mmrl.trainer.plan import plan_updates

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runtime(tiny_model_dir: Path, colors_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    with demo_runtime(tiny_model_dir, colors_dir, tmp_path_factory.mktemp("lora"), "trainer.lr=0.05",
                      "trainer.lora.enabled=true", "trainer.lora.rank=4", "trainer.lora.alpha=8",
                      "algorithm.kl.coef=0.1") as rt:
        yield rt


def _groups(rt: Runtime, samples: list) -> list:
    sampling = SamplingConfig(n=4, max_new_tokens=4, temperature=1.0, forbidden_token_ids=rt.sampling.forbidden_token_ids)
    return run_rollout(rt.workers, samples, sampling).groups


def _mismatch(rt: Runtime, prompts: list, groups: list) -> float:
    seqs = make_sequences(prompts, groups)
    logprob_pass(rt.trainers, seqs, rt.cfg, old=True, reference=False)
    return float(np.mean(np.concatenate([np.abs(np.asarray(s.old_logprobs) - np.asarray(s.behaviour_logprobs))
                                         for s in seqs])))


def test_lora_trains_adapters_and_engines_get_merged_weights(runtime: Runtime, colors_samples: list) -> None:
    rt = runtime
    setup = ray.get([t.setup_info.remote() for t in rt.trainers])[0]
    assert 0 < setup["trainable"] < setup["params"] / 5, setup  # adapters only
    prompts = [rt.processor(s) for s in colors_samples[:6]]
    groups = _groups(rt, colors_samples[:6])
    assert _mismatch(rt, prompts, groups) <= 1e-4  # zero-initialised B: merged == base

    seqs = make_sequences(prompts, groups)
    logprob_pass(rt.trainers, seqs, rt.cfg, old=False, reference=True)
    # before any update the adapters are a no-op, so the reference (adapters off) is the policy
    assert all(np.allclose(s.ref_logprobs, s.behaviour_logprobs, atol=1e-4) for s in seqs)
    advantages = torch.randn(len(seqs), generator=torch.Generator().manual_seed(0)).tolist()
    for seq, adv in zip(seqs, advantages):
        seq.advantage = adv
    before = ray.get([t.full_state_dict.remote() for t in rt.trainers])[0]
    for _ in range(3):
        stats = ray.get([t.train_step.remote(x) for t, x in
                         zip(rt.trainers, plan_updates(seqs, world_size=2, micro_batch_size=64))])
        assert stats[0]["skipped_updates"] == 0
    after = ray.get([t.full_state_dict.remote() for t in rt.trainers])[0]
    assert set(before) == set(after) and not any(".lora_" in k or "base_layer" in k for k in after)
    changed = [k for k in after if not torch.equal(before[k], after[k])]
    assert changed and all(k.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"))
                           for k in changed), changed

    rt.weight_version += 1
    ray.get([t.sync_weights.remote(rt.engines, rt.weight_version, 1.0) for t in rt.trainers])
    groups = _groups(rt, colors_samples[:6])
    assert _mismatch(rt, prompts, groups) <= 1e-4  # the engine runs the merged policy
    seqs = make_sequences(prompts, groups)
    logprob_pass(rt.trainers, seqs, rt.cfg, old=True, reference=True)
    drift = np.mean([np.abs(np.asarray(s.old_logprobs) - np.asarray(s.ref_logprobs)).mean() for s in seqs])
    assert drift > 1e-3  # the reference stayed the base model while the policy moved


def test_old_and_reference_logprobs_stay_on_the_ranks(runtime: Runtime, colors_samples: list) -> None:
    """KL in the reward: each rank computes π_old and the reference for its own share of the
    update plan and keeps them; only one KL number per sequence reaches the driver, and it is
    the KL of the logprobs a driver-side pass computes. The update then uses the kept values
    (its first ratio is π/π_old = 1 on the same weights)."""
    from mmrl.algorithms.kl import sequence_kl
    from mmrl.controller.learn import trainer_side_logprobs

    rt = runtime
    rollout = run_rollout(rt.workers, colors_samples[6:10], SamplingConfig(
        n=4, max_new_tokens=4, forbidden_token_ids=rt.sampling.forbidden_token_ids))
    expected = make_sequences(rollout.prompts, rollout.groups)
    logprob_pass(rt.trainers, expected, rt.cfg, old=True, reference=True)
    seqs = make_sequences(rollout.prompts, rollout.groups)
    for s in seqs:  # a behaviour policy far from π: a ratio against it would be far from 1
        s.behaviour_logprobs = [-5.0] * len(s.behaviour_logprobs)
    inputs = plan_updates(seqs, world_size=2, micro_batch_size=4)
    kl = trainer_side_logprobs(rt.trainers, inputs, old=True, reference=True, kl_estimator="k1")
    assert sorted(kl) == [s.uid for s in seqs] and all(isinstance(v, float) for v in kl.values())
    assert all(s.old_logprobs is None and s.ref_logprobs is None for s in seqs)  # nothing came back
    for s in expected:
        assert abs(kl[s.uid] - sequence_kl(s.old_logprobs, s.ref_logprobs, s.loss_mask, "k1")) <= 1e-4
    stats = ray.get([t.train_step.remote(x) for t, x in zip(rt.trainers, inputs)])
    tokens = sum(m["tokens"] for m in stats)
    assert abs(sum(m["ratio_sum"] for m in stats) / tokens - 1.0) <= 1e-5  # the kept π_old is the policy
