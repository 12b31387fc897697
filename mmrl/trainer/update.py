"""The loss of one micro-batch, from the trainer's logprobs to a scalar to backpropagate.

Kept apart from the Ray/DeepSpeed actor so that every term can be checked on plain tensors:

    loss = [ Σ agg( w_BT · ℓ_policy(logπ, logπ_old, A) ) + β_kl · Σ agg(kl_BT) − β_ent · Σ agg(H_BT) ] · scale

where w_BT / the mask come from the rollout correction (TIS/MIS between the sampler μ and π_old),
`agg` is the numerator of the configured loss aggregation, and scale = world_size / D with D the
mini-batch's global denominator (DeepSpeed averages gradients over ranks).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from mmrl.algorithms.correction import rollout_correction
from mmrl.algorithms.kl import kl_estimate
from mmrl.algorithms.losses import aggregate_sum


@dataclass
class LossSettings:
    """The algorithm knobs the loss needs (picklable; part of TrainerSpec)."""

    policy_loss: str = "ppo_clip"
    policy_loss_args: dict[str, Any] = field(default_factory=dict)
    loss_agg: str = "token_mean"
    entropy_coef: float = 0.0
    kl_coef: float = 0.0  # in the loss; KL in the reward is applied by the controller
    kl_estimator: str = "k3"
    correction_mode: str = "none"
    correction_level: str = "token"
    correction_threshold: float = 2.0
    correction_threshold_low: float | None = None


# Sums over valid tokens (or sequences) that the controller divides by the batch totals.
SUM_KEYS = ("pg_loss", "entropy", "kl", "clipped", "tokens", "mismatch_tokens", "abs_logprob_diff", "ratio_sum",
            "correction_masked", "correction_truncated", "correction_weight_sum")


def micro_batch_loss(policy_loss: Callable[..., Any], settings: LossSettings, logprobs_BT: torch.Tensor,
                     entropy_BT: torch.Tensor, mask_BT: torch.Tensor, advantages_B: torch.Tensor,
                     behaviour_logprobs_BT: torch.Tensor, old_logprobs_BT: torch.Tensor | None,
                     ref_logprobs_BT: torch.Tensor | None, scale: float) -> tuple[torch.Tensor, dict[str, float]]:
    """(loss to backpropagate, additive statistics). `old_logprobs_BT` None means a single
    on-policy update: π_old is the current policy, detached (the same numbers, no extra pass)."""
    old_BT = logprobs_BT.detach() if old_logprobs_BT is None else old_logprobs_BT
    input_mask_BT = mask_BT
    weights_BT, mask_BT, corr = rollout_correction(
        old_BT, behaviour_logprobs_BT, input_mask_BT, mode=settings.correction_mode, level=settings.correction_level,
        threshold=settings.correction_threshold, threshold_low=settings.correction_threshold_low)
    loss_BT, stats = policy_loss(logprobs_BT, old_BT, advantages_B, mask_BT,
                                 **{"clip_low": 0.2, "clip_high": 0.2, **settings.policy_loss_args})
    loss_BT = loss_BT * weights_BT.detach()
    pg_sum = aggregate_sum(loss_BT, mask_BT, settings.loss_agg)
    total = pg_sum - settings.entropy_coef * aggregate_sum(entropy_BT, mask_BT, settings.loss_agg)
    kl_sum = torch.zeros(())
    if settings.kl_coef and ref_logprobs_BT is not None:
        kl_BT = kl_estimate(logprobs_BT, ref_logprobs_BT, settings.kl_estimator) * mask_BT
        kl_sum = aggregate_sum(kl_BT, mask_BT, settings.loss_agg)
        total = total + settings.kl_coef * kl_sum
    with torch.no_grad():
        valid_BT = mask_BT > 0
        sums = {
            "pg_loss": float(pg_sum),
            "entropy": float((entropy_BT.detach() * mask_BT).sum()),
            "kl": float(kl_sum),
            "clipped": float((stats["clipped_BT"] & valid_BT).sum()),
            "tokens": float(mask_BT.sum()),
            "ratio_sum": float((stats["ratio_BT"] * mask_BT).sum()),
            "correction_masked": corr["frac_tokens_masked"] * float(input_mask_BT.sum()),
            "correction_truncated": corr["frac_tokens_truncated"] * float(input_mask_BT.sum()),
            "correction_weight_sum": float((weights_BT * mask_BT).sum()),
        }
        # the mismatch before correction: MIS masks exactly the tokens that mismatch most
        diff_BT = (old_BT - behaviour_logprobs_BT).abs() * input_mask_BT
        sums["mismatch_tokens"] = float(input_mask_BT.sum())
        sums["abs_logprob_diff"] = float(diff_BT.sum())
        sums["max_abs_logprob_diff"] = float(diff_BT.max()) if diff_BT.numel() else 0.0
        # extremes of the sampler-vs-trainer ratio pi_old / mu (1.0 when there is no valid token)
        sums["max_mismatch_ratio"] = corr["ratio_max"] if float(input_mask_BT.sum()) else 1.0
        sums["min_mismatch_ratio"] = corr["ratio_min"] if float(input_mask_BT.sum()) else 1.0
    return total * scale, sums
