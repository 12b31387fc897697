"""Rollout–training mismatch correction: TIS (Yao, Liu et al., 2025) and MIS
(Liu, Li et al., "When speed kills stability", 2025).

The sampler μ (vLLM) and the trainer's recompute π_old use the same weights but different kernels,
so "on-policy" data is slightly off-policy. With the ratio w = π_old/μ (from old_logprobs_BT and
the sampler's behaviour_logprobs_BT):

  mode "tis"  truncated IS: weight min(w, C), detached; nothing is masked (verl rollout_is).
  mode "mis"  masked IS: tokens/sequences with w outside [threshold_low, C] are masked out; the
              kept ones are weighted by w (Seq-MIS w·1[w ≤ C]; IcePop k·1[α ≤ k ≤ β]).
  mode "rs"   rejection only: the same mask as "mis", kept weight 1 (verl rollout_rs, Geo-RS).
  mode "none" weight 1; only the mismatch stats are computed.

  level "token"      w_t = π_old(y_t)/μ(y_t)
  level "sequence"   w = Π_t w_t = exp(Σ_t log w_t), broadcast to the sequence's tokens
  level "geometric"  w = exp(mean_t log w_t), length-invariant (verl seq_mean_k1, Geo-RS)
Log-ratios are clamped to ±20 (per token, and the sequence sum) before exp(), as in verl.

Use (decoupled mode: IS corrects μ→π_old, PPO clipping handles π_old→π_θ):
    weights_BT, mask_BT, stats = rollout_correction(old_BT, behaviour_BT, mask_BT, mode="tis")
    loss_BT, _ = policy_loss(logprobs_BT, old_BT, adv, mask_BT, ...)
    loss = aggregate(loss_BT * weights_BT, mask_BT, mode)
weights_BT is 0 wherever the returned mask is 0, so aggregating with the *input* mask instead
(IcePop normalises by the original Σ|y_i|) also drops rejected tokens from the numerator.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["rollout_correction", "CORRECTION_MODES", "CORRECTION_LEVELS", "CORRECTION_LOG_RATIO_CLAMP"]

CORRECTION_MODES = ("none", "tis", "mis", "rs")
CORRECTION_LEVELS = ("token", "sequence", "geometric")
CORRECTION_LOG_RATIO_CLAMP = 20.0


def _check(mode: str, level: str, threshold: float, threshold_low: float | None) -> None:
    if mode not in CORRECTION_MODES:
        raise ValueError(f"unknown rollout correction mode {mode!r}; modes are: {', '.join(CORRECTION_MODES)}")
    if level not in CORRECTION_LEVELS:
        raise ValueError(f"unknown rollout correction level {level!r}; levels are: {', '.join(CORRECTION_LEVELS)}")
    if threshold <= 0:
        raise ValueError(f"threshold (upper bound C) must be > 0, got {threshold}")
    if threshold_low is not None and not 0.0 <= threshold_low < threshold:
        raise ValueError(f"need 0 <= threshold_low < threshold; got {threshold_low}, {threshold}")


def _log_weight(delta_BT: Tensor, valid_BT: Tensor, level: str) -> Tensor:
    """log w per token (B, T), broadcast from the sequence for the sequence levels."""
    if level == "token":
        return delta_BT
    sum_B = delta_BT.sum(dim=-1)
    if level == "sequence":
        log_w_B = sum_B.clamp(-CORRECTION_LOG_RATIO_CLAMP, CORRECTION_LOG_RATIO_CLAMP)
    else:
        log_w_B = sum_B / valid_BT.sum(dim=-1).clamp_min(1)
    return log_w_B.unsqueeze(-1).expand_as(delta_BT)


def _masked_stats(x_BT: Tensor, valid_BT: Tensor) -> tuple[float, float, float]:
    """(mean, min, max) of x over valid entries; zeros when there are none."""
    vals = x_BT[valid_BT]
    if vals.numel() == 0:
        return 0.0, 0.0, 0.0
    return float(vals.mean()), float(vals.min()), float(vals.max())


@torch.no_grad()
def rollout_correction(
    old_logprobs_BT: Tensor,
    behaviour_logprobs_BT: Tensor,
    mask_BT: Tensor,
    *,
    mode: str = "tis",
    level: str = "token",
    threshold: float = 2.0,
    threshold_low: float | None = None,
    **_: Any,
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """Importance weights and rejection mask for the μ→π_old mismatch (see module docstring).

    threshold is the upper bound C (TIS truncation / MIS rejection above it); threshold_low is
    the MIS/RS lower bound (None: no lower bound; TIS ignores it). Returns
      weights_BT  float32, detached; 0 wherever the returned mask is 0
      mask_BT     the input mask with rejected tokens removed (same dtype as the input)
      stats       floats; token stats over the input's valid tokens, seq_* over sequences with
                  at least one valid token:
        abs_logprob_diff_mean / _max   |log π_old − log μ| per token
        seq_abs_logprob_diff_mean / _max   the per-sequence mean of |Δ|, averaged / maxed
        ratio_mean / _min / _max       token ratio π_old/μ
        seq_ratio_mean / _min / _max   sequence ratio Π_t π_old/μ
        frac_tokens_truncated, frac_seqs_truncated   weight cut to C (tis; a sequence counts
                                       if any token was)
        frac_tokens_masked, frac_seqs_masked         rejected (mis, rs)
        weight_mean                    mean returned weight over the kept tokens
    """
    _check(mode, level, threshold, threshold_low)
    if old_logprobs_BT.shape != behaviour_logprobs_BT.shape or old_logprobs_BT.shape != mask_BT.shape:
        raise ValueError(f"shape mismatch: old {tuple(old_logprobs_BT.shape)}, behaviour "
                         f"{tuple(behaviour_logprobs_BT.shape)}, mask {tuple(mask_BT.shape)}")
    valid_BT = mask_BT if mask_BT.dtype == torch.bool else mask_BT > 0
    # fp32: bf16 log-ratios of ~1e-3 (the typical mismatch) would round away.
    raw_BT = old_logprobs_BT.detach().float() - behaviour_logprobs_BT.detach().float()
    delta_BT = torch.where(valid_BT, raw_BT, torch.zeros_like(raw_BT))
    delta_BT = delta_BT.clamp(-CORRECTION_LOG_RATIO_CLAMP, CORRECTION_LOG_RATIO_CLAMP)
    w_BT = torch.exp(_log_weight(delta_BT, valid_BT, level))

    truncated_BT = torch.zeros_like(valid_BT)
    keep_BT = valid_BT
    if mode == "tis":
        truncated_BT = valid_BT & (w_BT > threshold)
        weights_BT = w_BT.clamp(max=threshold)
    elif mode in ("mis", "rs"):
        in_range_BT = w_BT <= threshold
        if threshold_low is not None:
            in_range_BT &= w_BT >= threshold_low
        keep_BT = valid_BT & in_range_BT
        weights_BT = w_BT if mode == "mis" else torch.ones_like(w_BT)
    else:
        weights_BT = torch.ones_like(w_BT)
    weights_BT = torch.where(keep_BT, weights_BT, torch.zeros_like(weights_BT))
    new_mask_BT = keep_BT.to(mask_BT.dtype)

    seq_valid_B = valid_BT.any(dim=-1)
    n_tok = max(int(valid_BT.sum()), 1)
    n_seq = max(int(seq_valid_B.sum()), 1)
    abs_BT = delta_BT.abs()
    seq_abs_B = abs_BT.sum(-1) / valid_BT.sum(-1).clamp_min(1)
    seq_ratio_B = torch.exp(delta_BT.sum(-1).clamp(-CORRECTION_LOG_RATIO_CLAMP, CORRECTION_LOG_RATIO_CLAMP))
    masked_BT = valid_BT & ~keep_BT
    stats: dict[str, float] = {}
    for prefix, x, valid in (("", torch.exp(delta_BT), valid_BT), ("seq_", seq_ratio_B, seq_valid_B)):
        mean, lo, hi = _masked_stats(x, valid)
        stats.update({f"{prefix}ratio_mean": mean, f"{prefix}ratio_min": lo, f"{prefix}ratio_max": hi})
    for prefix, x, valid in (("", abs_BT, valid_BT), ("seq_", seq_abs_B, seq_valid_B)):
        mean, _, hi = _masked_stats(x, valid)
        stats.update({f"{prefix}abs_logprob_diff_mean": mean, f"{prefix}abs_logprob_diff_max": hi})
    stats["frac_tokens_truncated"] = float(truncated_BT.sum()) / n_tok
    stats["frac_seqs_truncated"] = float(truncated_BT.any(-1).sum()) / n_seq
    stats["frac_tokens_masked"] = float(masked_BT.sum()) / n_tok
    stats["frac_seqs_masked"] = float(masked_BT.any(-1).sum()) / n_seq
    stats["weight_mean"] = _masked_stats(weights_BT, keep_BT)[0]
    return weights_BT, new_mask_BT, stats
