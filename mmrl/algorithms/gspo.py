"""GSPO policy losses (Zheng et al., Qwen, arXiv 2507.18071).

GSPO replaces PPO's token ratio with a length-normalised *sequence* ratio
    s_i = (π_θ(y_i|x) / π_old(y_i|x))^{1/|y_i|} = exp(mean_t log ρ_{i,t})
and clips it at the sequence level with small ranges (paper: ε_low=3e-4, ε_high=4e-4).

Aggregation: both losses return a per-token matrix meant to be reduced with
`seq_mean_token_mean`, which is the GSPO objective (1/B) Σ_i ℓ_i. Each function carries
`agg_mode = "seq_mean_token_mean"`; verl forces that mode for GSPO whatever `loss_agg_mode` says,
and the trainer should do the same. (token_mean would weight ℓ_i by |y_i|, i.e. not GSPO.)

Neither has dual-clip (`dual_clip_c` is accepted and ignored, as in verl). Configure the small clip
ranges explicitly: the trainer passes its clip_low/clip_high (PPO's 0.2 by default) through.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from mmrl.algorithms.losses import check_loss_inputs
from mmrl.registry import register

__all__ = ["gspo", "gspo_token", "GSPO_LOG_RATIO_MAX", "GSPO_AGG_MODE"]

# verl clamps log s at 10 (s ≤ e^10) so one runaway sequence cannot overflow the loss.
GSPO_LOG_RATIO_MAX = 10.0
GSPO_AGG_MODE = "seq_mean_token_mean"


def _check_clip(clip_low: float, clip_high: float) -> None:
    if not 0.0 <= clip_low < 1.0 or clip_high < 0.0:
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0; got {clip_low}, {clip_high}")


def _seq_log_ratio(logprobs_BT: Tensor, old_logprobs_BT: Tensor, valid_BT: Tensor) -> tuple[Tensor, Tensor]:
    """(lp_BT with masked positions zeroed, mean_t log ρ over valid tokens as (B,)).

    torch.where first: garbage (inf/nan) at padding must not reach the backward pass.
    A sequence without valid tokens gets log s = 0 (its loss is masked anyway).
    """
    lp_BT = torch.where(valid_BT, logprobs_BT, torch.zeros_like(logprobs_BT))
    old_BT = torch.where(valid_BT, old_logprobs_BT.detach(), torch.zeros_like(lp_BT))
    n_B = valid_BT.sum(dim=-1).clamp_min(1).to(lp_BT.dtype)
    return lp_BT, (lp_BT - old_BT).sum(dim=-1) / n_B


def _clipped_surrogate(ratio: Tensor, adv: Tensor, clip_low: float, clip_high: float) -> tuple[Tensor, Tensor]:
    """PPO's pessimistic max(-Aρ, -A·clip(ρ)); returns (loss, clipped branch active)."""
    loss1 = -adv * ratio
    loss2 = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(loss1, loss2), loss2 > loss1


def _stats(valid_BT: Tensor, ratio_BT: Tensor, clipped_BT: Tensor) -> dict[str, Tensor]:
    return {
        "ratio_BT": torch.where(valid_BT, ratio_BT, torch.ones_like(ratio_BT)).detach(),
        "clipped_BT": (clipped_BT & valid_BT).detach(),
        "dual_clipped_BT": torch.zeros_like(valid_BT),  # no dual-clip in GSPO; same keys as ppo_clip
    }


@register("policy_loss", "gspo")
def gspo(
    logprobs_BT: Tensor,
    old_logprobs_BT: Tensor,
    advantages_B: Tensor,
    mask_BT: Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    **_: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO, sequence level: ℓ_i = max(-A_i s_i, -A_i clip(s_i, 1-ε_low, 1+ε_high)).

    s_i = exp(min(mean_t (lp - old), 10)) keeps its gradient through every valid token
    (∂ log s_i / ∂ lp_t = 1/|y_i|). ℓ_i is written on each valid token of sequence i, so
    `seq_mean_token_mean` gives (1/B) Σ_i ℓ_i. A (B, T) advantage is reduced to its masked mean per
    sequence (equal to A_i when it was broadcast); use `gspo_token` for per-token advantages.

    stats: ratio_BT = s_i on valid tokens (1 elsewhere); clipped_BT = the sequence was clipped
    (so the fraction of clipped tokens is length-weighted); dual_clipped_BT all False.
    """
    _check_clip(clip_low, clip_high)
    valid_BT, adv_BT = check_loss_inputs(logprobs_BT, old_logprobs_BT, advantages_B, mask_BT)
    if advantages_B.dim() == 1:
        adv_B = adv_BT[:, 0]
    else:
        n_B = valid_BT.sum(-1).clamp_min(1).to(adv_BT.dtype)
        adv_B = torch.where(valid_BT, adv_BT, torch.zeros_like(adv_BT)).sum(-1) / n_B
    _, log_s_B = _seq_log_ratio(logprobs_BT, old_logprobs_BT, valid_BT)
    s_B = torch.exp(log_s_B.clamp(max=GSPO_LOG_RATIO_MAX))
    loss_B, clipped_B = _clipped_surrogate(s_B, adv_B, clip_low, clip_high)
    loss_BT = torch.where(valid_BT, loss_B.unsqueeze(-1).expand_as(logprobs_BT), torch.zeros_like(logprobs_BT))
    stats = _stats(valid_BT, s_B.unsqueeze(-1).expand_as(logprobs_BT), clipped_B.unsqueeze(-1).expand_as(valid_BT))
    return loss_BT, stats


@register("policy_loss", "gspo_token")
def gspo_token(
    logprobs_BT: Tensor,
    old_logprobs_BT: Tensor,
    advantages_B: Tensor,
    mask_BT: Tensor,
    *,
    clip_low: float = 3e-4,
    clip_high: float = 4e-4,
    **_: Any,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO-token: s_{i,t} = sg[s_i] · π_θ(y_t) / sg[π_θ(y_t)], clipped per token.

    In log space log s_{i,t} = lp_t - sg(lp_t) + sg(log s_i), clamped at max 10 (verl's
    `compute_policy_loss_gspo`). Its value is s_i on every token, and ∂s_{i,t}/∂lp_t = s_i, so with
    one advantage per sequence and `seq_mean_token_mean` its value and gradient equal `gspo`'s;
    unlike `gspo` it takes genuine per-token advantages (B, T) (e.g. multi-turn credit).

    stats: ratio_BT = s_{i,t} (= s_i) on valid tokens; clipped_BT per token; dual_clipped_BT False.
    """
    _check_clip(clip_low, clip_high)
    valid_BT, adv_BT = check_loss_inputs(logprobs_BT, old_logprobs_BT, advantages_B, mask_BT)
    lp_BT, log_s_B = _seq_log_ratio(logprobs_BT, old_logprobs_BT, valid_BT)
    log_s_BT = lp_BT - lp_BT.detach() + log_s_B.detach().unsqueeze(-1)
    s_BT = torch.exp(log_s_BT.clamp(max=GSPO_LOG_RATIO_MAX))
    loss_BT, clipped_BT = _clipped_surrogate(s_BT, adv_BT, clip_low, clip_high)
    loss_BT = torch.where(valid_BT, loss_BT, torch.zeros_like(loss_BT))
    return loss_BT, _stats(valid_BT, s_BT, clipped_BT)


# The aggregation these losses are defined with; the trainer should use it instead of its default.
gspo.agg_mode = GSPO_AGG_MODE  # type: ignore[attr-defined]
gspo_token.agg_mode = GSPO_AGG_MODE  # type: ignore[attr-defined]
