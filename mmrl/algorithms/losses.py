"""Policy losses (per-token loss matrices) and their aggregation into a scalar.

A policy loss returns the per-token loss `loss_BT` *before* aggregation plus per-token stats, so
that rollout-correction weights can multiply it elementwise and the trainer chooses how to reduce
it (the modes follow verl's `agg_loss`). Aggregation is split into a numerator (`aggregate_sum`) and a
denominator (`aggregate_denominator`) because the trainer reduces over micro-batches and
data-parallel ranks that must all share one global denominator.

Every policy loss has the signature
    fn(logprobs_BT, old_logprobs_BT, advantages_B, mask_BT, *, clip_low, clip_high, **kwargs)
        -> (loss_BT, stats)   with stats["ratio_BT"] and stats["clipped_BT"] (bool) at least,
and ignores keyword arguments it does not use (the trainer passes one config dict). Losses stay
pure: rollout-correction weights (mmrl.algorithms.correction) are *not* an argument; the trainer
multiplies `loss_BT * weights_BT` (detached) before aggregating, as verl does.
GSPO variants live in gspo.py.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from mmrl.registry import register

__all__ = [
    "ppo_clip", "check_loss_inputs", "aggregate", "aggregate_sum", "aggregate_denominator",
    "entropy_from_logits", "entropy_from_logprobs",
    "AGG_MODES", "ADDITIVE_MODES", "LOG_RATIO_CLAMP",
]

# exp() of a log-ratio beyond this overflows in fp32 / is meaningless anyway (verl uses 20 too).
LOG_RATIO_CLAMP = 20.0


def check_loss_inputs(logprobs_BT: Tensor, old_logprobs_BT: Tensor, advantages_B: Tensor,
                      mask_BT: Tensor) -> tuple[Tensor, Tensor]:
    """Validate shapes; return (bool valid_BT, advantages broadcast to (B, T) in the logprob dtype).

    Advantages may be one per sequence (B,) or one per token (B, T).
    """
    if logprobs_BT.shape != old_logprobs_BT.shape or logprobs_BT.shape != mask_BT.shape:
        raise ValueError(f"shape mismatch: logprobs {tuple(logprobs_BT.shape)}, old_logprobs "
                         f"{tuple(old_logprobs_BT.shape)}, mask {tuple(mask_BT.shape)}")
    valid_BT = mask_BT > 0 if mask_BT.dtype != torch.bool else mask_BT
    adv = advantages_B.to(logprobs_BT.dtype)
    adv_BT = adv.unsqueeze(-1) if adv.dim() == 1 else adv
    if adv_BT.shape[0] != logprobs_BT.shape[0]:
        raise ValueError(f"advantages {tuple(advantages_B.shape)} do not match logprobs "
                         f"{tuple(logprobs_BT.shape)}: need (B,) or (B, T)")
    return valid_BT, adv_BT.expand_as(logprobs_BT)


@register("policy_loss", "ppo_clip")
def ppo_clip(
    logprobs_BT: Tensor,
    old_logprobs_BT: Tensor,
    advantages_B: Tensor,
    mask_BT: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip_c: float | None = None,
    **_: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate (verl `vanilla`), optionally with dual-clip, per token.

    ρ = exp(clamp(lp - old, ±20)); ℓ1 = -Aρ; ℓ2 = -A·clip(ρ, 1-ε_low, 1+ε_high); ℓ = max(ℓ1, ℓ2);
    where A < 0 and `dual_clip_c` is set: ℓ = min(ℓ, -c·A), which caps the loss of a token whose
    ratio exploded (arXiv 1912.09729).

    `advantages_B` is one advantage per sequence (broadcast over tokens); a (B, T) tensor of
    per-token advantages is accepted too. Masked positions get loss 0 and no gradient, even if
    their logprobs are garbage (inf/nan from padding).

    Returns (loss_BT, stats) with detached stats:
      ratio_BT          ρ
      clipped_BT        bool, the ε-clipped branch won the max and differs (verl pg_clipfrac)
      dual_clipped_BT   bool, the dual-clip cap was active (verl pg_clipfrac_lower)
    """
    if not 0.0 <= clip_low < 1.0 or clip_high < 0.0:
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0; got {clip_low}, {clip_high}")
    if dual_clip_c is not None and dual_clip_c <= 1.0:
        raise ValueError(f"dual_clip_c must be > 1 (verl clip_ratio_c, usually 3.0); got {dual_clip_c}")
    valid_BT, adv_BT = check_loss_inputs(logprobs_BT, old_logprobs_BT, advantages_B, mask_BT)

    # torch.where before exp(): masked garbage must not reach the backward pass as nan.
    log_ratio_BT = torch.where(valid_BT, logprobs_BT - old_logprobs_BT.detach(),
                               torch.zeros_like(logprobs_BT))
    ratio_BT = torch.exp(log_ratio_BT.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    loss1_BT = -adv_BT * ratio_BT
    loss2_BT = -adv_BT * ratio_BT.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_BT = torch.maximum(loss1_BT, loss2_BT)
    clipped_BT = (loss2_BT > loss1_BT) & valid_BT

    if dual_clip_c is not None:
        cap_BT = -dual_clip_c * adv_BT
        dual_BT = (adv_BT < 0) & (cap_BT < loss_BT)
        loss_BT = torch.where(dual_BT, cap_BT, loss_BT)
        dual_clipped_BT = dual_BT & valid_BT
    else:
        dual_clipped_BT = torch.zeros_like(valid_BT)

    loss_BT = torch.where(valid_BT, loss_BT, torch.zeros_like(loss_BT))
    stats = {
        "ratio_BT": ratio_BT.detach(),
        "clipped_BT": clipped_BT.detach(),
        "dual_clipped_BT": dual_clipped_BT.detach(),
    }
    return loss_BT, stats


# --------------------------------------------------------------------------------------------
# Aggregation
# --------------------------------------------------------------------------------------------

AGG_MODES = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "seq_mean_token_sum_norm")
# Modes whose denominator is a count: the denominators of micro-batches and ranks add up.
# seq_mean_token_sum_norm divides by a constant instead (the same on every micro-batch and rank).
ADDITIVE_MODES = frozenset({"token_mean", "seq_mean_token_sum", "seq_mean_token_mean"})


def _mode(mode: str) -> str:
    """Accept verl's spelling (token-mean) as well as ours (token_mean)."""
    m = str(mode).replace("-", "_")
    if m not in AGG_MODES:
        raise ValueError(f"unknown loss aggregation mode {mode!r}; modes are: {', '.join(AGG_MODES)}")
    return m


def aggregate_sum(loss_BT: Tensor, mask_BT: Tensor, mode: str = "token_mean") -> Tensor:
    """The numerator of `aggregate`: a scalar that sums over sequences and can be added up.

    token_mean / seq_mean_token_sum / seq_mean_token_sum_norm: Σ_i Σ_t m·ℓ
    seq_mean_token_mean:                                      Σ_i (Σ_t m·ℓ / Σ_t m)
    """
    m = _mode(mode)
    w_BT = mask_BT.to(loss_BT.dtype)
    tok_sum_B = (loss_BT * w_BT).sum(dim=-1)
    if m == "seq_mean_token_mean":
        # a sequence with no valid token contributes 0 (and is not counted in the denominator)
        return (tok_sum_B / w_BT.sum(dim=-1).clamp_min(1.0)).sum()
    return tok_sum_B.sum()


def aggregate_denominator(mask_BT: Tensor | Sequence[Tensor], mode: str = "token_mean", *,
                          scale: float | None = None) -> float:
    """The denominator of `aggregate`, for one micro-batch or a list of them.

    Why the split: the trainer runs the loss per micro-batch (and per data-parallel rank) but the
    loss must equal the aggregate over the whole mini-batch. So each micro-batch contributes
    `aggregate_sum(...) / D`, with one global D computed before the first backward:
      - ADDITIVE_MODES (token_mean: number of valid tokens; seq_mean_*: number of sequences with
        at least one valid token) -> D = sum over micro-batches (and all-reduce SUM over ranks);
      - seq_mean_token_sum_norm -> D = `scale` (Dr. GRPO's constant; default the padded length T,
        the max over the given micro-batches), identical everywhere, never summed.
    Under data parallelism, gradient averaging divides by the world size, so multiply each rank's
    loss by dp_size (as verl does). The raw count is returned (it may be 0 for an all-masked
    micro-batch, so sums stay exact); divide by max(D, 1) as `aggregate` does.
    """
    m = _mode(mode)
    masks = [mask_BT] if isinstance(mask_BT, Tensor) else list(mask_BT)
    if m == "seq_mean_token_sum_norm":
        if scale is not None:
            if scale <= 0:
                raise ValueError(f"scale must be > 0, got {scale}")
            return float(scale)
        return float(max((mk.shape[-1] for mk in masks), default=1))
    total = 0.0
    for mk in masks:
        w = mk.float() if mk.dtype == torch.bool else mk.to(torch.float32)
        if m == "token_mean":
            total += float(w.sum())
        else:
            total += float((w.sum(dim=-1) > 0).sum())
    return total


def aggregate(loss_BT: Tensor, mask_BT: Tensor, mode: str = "token_mean", *,
              scale: float | None = None) -> Tensor:
    """Reduce a per-token loss to a scalar.

    token_mean               Σ mℓ / Σ m                       (DAPO, verl default)
    seq_mean_token_sum       Σ_i Σ_t mℓ / B
    seq_mean_token_mean      Σ_i (Σ_t mℓ / Σ_t m) / B          (original GRPO)
    seq_mean_token_sum_norm  Σ_i Σ_t mℓ / scale                (Dr. GRPO; scale default T)
    B counts sequences with at least one valid token. Equals aggregate_sum / aggregate_denominator.
    """
    num = aggregate_sum(loss_BT, mask_BT, mode)
    den = aggregate_denominator(mask_BT, mode, scale=scale)
    return num / max(den, 1.0) if _mode(mode) in ADDITIVE_MODES else num / den


def entropy_from_logits(logits_BTV: Tensor) -> Tensor:
    """Per-token entropy (B, T) of softmax(logits), via log_softmax for stability.

    Computed in fp32 for bf16/fp16 logits (their softmax is too coarse for small probabilities).
    Logits of -inf (masked vocabulary entries) contribute 0 without producing nan gradients.
    """
    x = logits_BTV.float() if logits_BTV.dtype in (torch.float16, torch.bfloat16) else logits_BTV
    return entropy_from_logprobs(F.log_softmax(x, dim=-1))


def entropy_from_logprobs(logp: Tensor) -> Tensor:
    """Per-token entropy (B, T) from full-vocabulary log-probs (B, T, V), when the caller already
    has them (the trainer does: it gathers the sampled tokens' logprobs from the same tensor)."""
    p = logp.exp()
    # p·log p is 0·(-inf) = nan where p == 0: zero those log p first (masked_fill has a safe grad).
    logp_safe = logp.masked_fill(torch.isinf(logp), 0.0)
    return -(p * logp_safe).sum(dim=-1)
