"""Outcome advantage estimators: one scalar reward per response -> one advantage per response.

Every estimator has the same signature, `fn(rewards_BG, **kwargs) -> advantages_BG`, where B is
the number of prompts and G the number of responses sampled per prompt (the group). Unused
keyword arguments are ignored so the trainer can pass one config dict to whichever estimator is
selected. The advantage is broadcast to every response token by the policy loss.
Papers: GRPO (Shao et al., arXiv 2402.03300), Dr. GRPO (Liu et al., arXiv 2503.20783), RLOO
(Ahmadian et al., arXiv 2402.14740), REINFORCE++ (Hu, arXiv 2501.03262).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from mmrl.registry import register

__all__ = ["grpo", "rloo", "dr_grpo", "reinforce_pp_baseline", "reinforce_pp", "reinforce_pp_token"]


def _as_groups(rewards_BG: Tensor) -> Tensor:
    """Validate the (B, G) layout and work in floating point (integer rewards are common)."""
    if not isinstance(rewards_BG, Tensor):
        rewards_BG = torch.as_tensor(rewards_BG)
    if rewards_BG.dim() != 2:
        raise ValueError(f"rewards_BG must have shape (prompts B, group size G); got {tuple(rewards_BG.shape)}")
    if not rewards_BG.is_floating_point():
        rewards_BG = rewards_BG.to(torch.float32)
    return rewards_BG


@register("advantage", "grpo")
def grpo(rewards_BG: Tensor, *, norm_by_std: bool = True, eps: float = 1e-6, **_: Any) -> Tensor:
    """GRPO: (r - mean_G) / (std_G + eps), unbiased std as in verl; a group of one gets 0.

    A group of size 1 has no baseline to compare against, so its advantage is 0 (verl uses mean 0
    and std 1 there, which would push the raw reward instead). `norm_by_std=False` gives r - mean.
    """
    r = _as_groups(rewards_BG)
    if r.shape[1] == 1:
        return torch.zeros_like(r)
    centred = r - r.mean(dim=1, keepdim=True)
    if not norm_by_std:
        return centred
    return centred / (r.std(dim=1, keepdim=True) + eps)


@register("advantage", "rloo")
def rloo(rewards_BG: Tensor, **_: Any) -> Tensor:
    """RLOO: r_i minus the mean of the other G-1 rewards, i.e. G/(G-1) * (r - mean_G).

    The leave-one-out baseline does not depend on r_i, so the estimator stays unbiased.
    """
    r = _as_groups(rewards_BG)
    g = r.shape[1]
    if g == 1:
        return torch.zeros_like(r)
    return (r - r.mean(dim=1, keepdim=True)) * (g / (g - 1))


@register("advantage", "dr_grpo")
def dr_grpo(rewards_BG: Tensor, **_: Any) -> Tensor:
    """Dr. GRPO: r - mean_G without the std division (which over-weights easy/hard prompts)."""
    r = _as_groups(rewards_BG)
    return r - r.mean(dim=1, keepdim=True)


@register("advantage", "reinforce_pp_baseline")
def reinforce_pp_baseline(rewards_BG: Tensor, *, eps: float = 1e-6, **_: Any) -> Tensor:
    """REINFORCE++-baseline: (r - mean_G) / (std over the whole batch + eps).

    The group mean is the baseline; the scale is one unbiased std over all B·G centred rewards
    (not per group), so prompts the policy is unsure about are not inflated to unit variance.
    Whitening would also subtract the batch mean, but the centred rewards already average 0.
    verl whitens per token (lengths weight the mean); per sequence, a constant group stays 0.
    """
    r = _as_groups(rewards_BG)
    centred = r - r.mean(dim=1, keepdim=True)
    if centred.numel() < 2:
        return torch.zeros_like(r)
    return centred / (centred.std() + eps)


@register("advantage", "reinforce_pp")
def reinforce_pp(rewards_BG: Tensor, *, eps: float = 1e-6, **_: Any) -> Tensor:
    """REINFORCE++ with outcome rewards: (r - mean_batch) / (std_batch + eps), no group baseline.

    With one reward on the last token and γ = 1 the return is r at every token, so this is the
    paper's global whitening, per sequence. A constant group is *not* zeroed: the
    baseline is the batch, not the prompt. For token rewards / γ < 1 use `reinforce_pp_token`.
    """
    r = _as_groups(rewards_BG)
    if r.numel() < 2:
        return torch.zeros_like(r)
    return (r - r.mean()) / (r.std() + eps)


def reinforce_pp_token(token_rewards_BT: Tensor, mask_BT: Tensor, *, gamma: float = 1.0,
                       eps: float = 1e-8) -> Tensor:
    """REINFORCE++ on per-token rewards (e.g. score on the last token minus β·KL per token).

    G_t = Σ_{k≥t} γ^{k-t} r_k over valid tokens, then whitened over all valid tokens of the batch
    ((G - mean) / sqrt(unbiased var + eps), as verl's masked_whiten). Returns advantages_BT,
    0 at masked positions. Not a registered estimator: its input is per token, not per group.
    """
    if token_rewards_BT.shape != mask_BT.shape:
        raise ValueError(f"shape mismatch: token rewards {tuple(token_rewards_BT.shape)}, "
                         f"mask {tuple(mask_BT.shape)}")
    w_BT = mask_BT.to(torch.float32) if mask_BT.dtype == torch.bool else mask_BT.float()
    r_BT = torch.where(w_BT > 0, token_rewards_BT.float(), torch.zeros_like(w_BT))
    returns_BT = torch.zeros_like(r_BT)
    running_B = torch.zeros_like(r_BT[:, 0])
    for t in reversed(range(r_BT.shape[1])):
        # masked positions (padding, tool output) pass the return through without discounting
        running_B = torch.where(w_BT[:, t] > 0, r_BT[:, t] + gamma * running_B, running_B)
        returns_BT[:, t] = running_B
    n = w_BT.sum()
    if n < 2:
        return torch.zeros_like(r_BT)
    mean = (returns_BT * w_BT).sum() / n
    var = (((returns_BT - mean) ** 2) * w_BT).sum() / (n - 1)
    return (returns_BT - mean) * torch.rsqrt(var + eps) * w_BT
