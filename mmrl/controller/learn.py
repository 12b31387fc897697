"""From scored groups to a policy update: sequences, the logprob pass (π_old / reference),
KL in the reward, advantages, the update plan, the update on every rank, and its metrics.

Called by the loop once rollout and rewards are done for a step; all trainer calls are
collective (every rank gets a call, in the same order).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np
import ray
import torch

from mmrl.algorithms.entropy import entropy_coef_at
from mmrl.config.schema import Config
from mmrl.processors import ProcessedPrompt, PromptRef
from mmrl.rollout.types import Trajectory
from mmrl.trainer.batch import TrainSequence
from mmrl.trainer.plan import StepInputs, padded_tokens, plan_forward_only, plan_updates
from mmrl.utils.timing import StepSpans


def needs_old_logprobs(cfg: Config) -> bool:
    """π_old differs from the policy being trained once a batch gets more than one update. In an
    async run it is the proximal policy π_prox of the decoupled objective (the PPO ratio is
    π/π_prox, the rollout correction weighs π_prox/μ, μ being the engines' stale behaviour);
    π_prox is the policy before the batch's first update, so with ONE update per batch it is
    the current policy itself, which the update's own forward gives, detached
    (`micro_batch_loss` with no old logprobs): a recompute pass would produce the same numbers."""
    mode = cfg.algorithm.old_logprobs.value
    if mode != "auto":
        return mode == "recompute"
    return cfg.algorithm.ppo_epochs * cfg.algorithm.mini_batches > 1


def needs_reference(cfg: Config) -> bool:
    return cfg.algorithm.kl.coef > 0


def make_sequences(prompts: Sequence[ProcessedPrompt | PromptRef], groups: Sequence[Sequence[Trajectory]]) -> list[TrainSequence]:
    seqs = [TrainSequence.from_prompt(t.prompt_ref or prompts[i], t.response_ids, t.behaviour_logprobs, t.loss_mask,
                                      response_ref=t.response_inputs, routed_experts=t.routed_experts)
            for i, group in enumerate(groups) for t in group]
    for uid, seq in enumerate(seqs):
        seq.uid = uid
    return seqs


def logprob_pass(trainers: Sequence[Any], seqs: list[TrainSequence], cfg: Config, *, old: bool, reference: bool) -> None:
    """Fill `old_logprobs` / `ref_logprobs` of every sequence on the driver, with one no-grad pass
    each (diagnostics and tests; training keeps them on the ranks: `trainer_side_logprobs`)."""
    chunks, order = plan_forward_only(seqs, world_size=len(trainers), micro_batch_size=cfg.trainer.micro_batch_size,
                                      max_tokens_per_micro_batch=cfg.trainer.max_tokens_per_micro_batch,
                                      padding_free=cfg.trainer.padding_free)
    for policy, attr, wanted in (("current", "old_logprobs", old), ("reference", "ref_logprobs", reference)):
        if not wanted:
            continue
        per_rank = ray.get([t.compute_logprobs.remote(c, policy) for t, c in zip(trainers, chunks)])
        for indices, values in zip(order, per_rank):
            for i, lp in zip(indices, values):
                setattr(seqs[i], attr, lp)


def trainer_side_logprobs(trainers: Sequence[Any], inputs: Sequence[StepInputs], *, old: bool, reference: bool,
                          kl_estimator: str | None) -> dict[int, float]:
    """π_old / reference logprobs computed by each rank for its own share of the update plan and
    kept there (`TrainerWorker.keep_logprobs`); only the per-sequence KL comes back, when the KL
    goes into the reward."""
    policies = [p for p, wanted in (("current", old), ("reference", reference)) if wanted]
    kl: dict[int, float] = {}
    for per_rank in ray.get([t.keep_logprobs.remote(x, policies, kl_estimator) for t, x in zip(trainers, inputs)]):
        kl.update(per_rank)
    return kl


def merge_rank_stats(per_rank: list[dict[str, Any]]) -> dict[str, float]:
    """Batch-level metrics from the ranks' additive sums."""
    tokens = max(sum(m["tokens"] for m in per_rank), 1.0)
    mismatch_tokens = max(sum(m["mismatch_tokens"] for m in per_rank), 1.0)
    norms = list(per_rank[0]["grad_norms"])
    finite = [n for n in norms if np.isfinite(n)]
    updates = max(per_rank[0]["updates"], 1)
    # MoE models with the engine's routing recorded: the share of (sampled token, MoE layer)
    # pairs where the trainer's own router picks the engine's top-k set (with or without replay)
    router_pairs = sum(m.get("router_pairs", 0.0) for m in per_rank)
    router = {"mismatch/router_agreement": sum(m.get("router_agree", 0.0) for m in per_rank) / router_pairs} \
        if router_pairs else {}
    return {
        **router,
        "loss/pg": sum(m["pg_loss"] for m in per_rank) / tokens,
        "actor/entropy": sum(m["entropy"] for m in per_rank) / tokens,
        "actor/kl": sum(m["kl"] for m in per_rank) / tokens,
        "actor/clip_fraction": sum(m["clipped"] for m in per_rank) / tokens,
        "actor/ratio_mean": sum(m["ratio_sum"] for m in per_rank) / tokens,
        "actor/grad_norm": float(np.mean(finite)) if finite else float("nan"),
        "actor/grad_norm_max": float(max(norms)) if norms else float("nan"),
        "actor/updates": float(updates),
        "actor/response_tokens": tokens / updates,
        "train/nonfinite_skipped": float(per_rank[0]["skipped_updates"]),
        "mismatch/mean_abs_logprob_diff": sum(m["abs_logprob_diff"] for m in per_rank) / mismatch_tokens,
        "mismatch/max_abs_logprob_diff": max(m["max_abs_logprob_diff"] for m in per_rank),
        "mismatch/ratio_max": max(m["max_mismatch_ratio"] for m in per_rank),
        "mismatch/ratio_min": min(m["min_mismatch_ratio"] for m in per_rank),
        "mismatch/correction_masked_fraction": sum(m["correction_masked"] for m in per_rank) / mismatch_tokens,
        "mismatch/correction_truncated_fraction": sum(m["correction_truncated"] for m in per_rank) / mismatch_tokens,
        "mismatch/correction_weight_mean": sum(m["correction_weight_sum"] for m in per_rank) / tokens,
    }


def update_policy(trainers: Sequence[Any], cfg: Config, prompts: Sequence[ProcessedPrompt | PromptRef],
                  groups: Sequence[Sequence[Trajectory]], advantage_fn: Any, spans: StepSpans,
                  step: int) -> dict[str, float]:
    """Everything after rewards: returns the step's learning metrics. The update plan comes
    first (it needs lengths only): the ranks recompute π_old / reference logprobs for exactly the
    sequences they will train on and keep them; the advantages are filled in afterwards."""
    metrics: dict[str, float] = {}
    seqs = make_sequences(prompts, groups)
    rewards_BG = torch.tensor([[t.reward for t in g] for g in groups], dtype=torch.float32)
    old, reference = needs_old_logprobs(cfg), needs_reference(cfg)
    behaviour_is_old = cfg.algorithm.old_logprobs.value == "behaviour"
    if behaviour_is_old:
        for seq in seqs:
            seq.old_logprobs = list(seq.behaviour_logprobs)
    kl_in_reward = reference and cfg.algorithm.kl.placement.value == "reward"
    inputs: list[StepInputs] = plan_updates(
        seqs, world_size=len(trainers), mini_batches=cfg.algorithm.mini_batches, epochs=cfg.algorithm.ppo_epochs,
        micro_batch_size=cfg.trainer.micro_batch_size,
        max_tokens_per_micro_batch=cfg.trainer.max_tokens_per_micro_batch, loss_agg=cfg.algorithm.loss_agg.value,
        seed=cfg.run.seed * 1_000_003 + step, padding_free=cfg.trainer.padding_free)
    kl_by_uid: dict[int, float] = {}
    if old or reference:
        with spans("logprob"):
            # KL in the reward is measured against π_old: recompute it too (unless π_old is μ)
            kl_by_uid = trainer_side_logprobs(
                trainers, inputs, old=old or (kl_in_reward and not behaviour_is_old), reference=reference,
                kl_estimator=cfg.algorithm.kl.estimator if kl_in_reward else None)
    if kl_in_reward:
        kl_B = torch.tensor([kl_by_uid[s.uid] for s in seqs])
        rewards_BG = rewards_BG - cfg.algorithm.kl.coef * kl_B.view(rewards_BG.shape)
        metrics["reward/kl_penalty"] = float(cfg.algorithm.kl.coef * kl_B.mean())
        metrics["actor/kl_sequence"] = float(kl_B.mean())
    advantages_BG = advantage_fn(rewards_BG, **cfg.algorithm.advantage_args)
    for seq, adv in zip(seqs, advantages_BG.flatten().tolist()):
        seq.advantage = adv  # the same objects the plan holds
    metrics["rollout/groups_all_same_reward"] = float((rewards_BG == rewards_BG[:, :1]).all(1).float().mean())
    metrics["actor/advantage_abs_mean"] = float(advantages_BG.abs().mean())
    schedule = cfg.algorithm.entropy_schedule
    entropy_coef = entropy_coef_at(step, cfg.algorithm.entropy_coef, schedule.kind.value, schedule.start_step,
                                   schedule.steps, schedule.end_coef)
    metrics["actor/entropy_coef"] = entropy_coef
    with spans("train"):
        per_rank = ray.get([t.train_step.remote(dataclasses.replace(x, entropy_coef=entropy_coef))
                            for t, x in zip(trainers, inputs)])
    metrics.update(merge_rank_stats(per_rank))
    metrics["actor/micro_batches"] = float(sum(len(m.micro_batches) for m in inputs[0].mini_batches))
    metrics.update(forward_token_metrics(inputs, cfg.trainer.padding_free))
    return metrics


def forward_token_metrics(inputs: Sequence[StepInputs], padding_free: bool) -> dict[str, float]:
    """Tokens one pass of the update's forwards computes over all ranks (fillers included), and
    the share of them that is padding: what trainer.padding_free removes."""
    chunks = [chunk for x in inputs for mini in x.mini_batches for chunk in mini.micro_batches if chunk]
    computed = sum(padded_tokens(c, padding_free) for c in chunks)
    real = sum(s.num_tokens for c in chunks for s in c)
    return {"actor/forward_tokens": float(computed), "actor/padding_fraction": 1.0 - real / computed if computed else 0.0}
