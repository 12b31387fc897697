"""Outcome advantage estimators: one scalar reward per response -> one advantage per response.

Every estimator has the same signature, `fn(rewards_BG, **kwargs) -> advantages_BG`, where B is
the number of prompts and G the number of responses sampled per prompt (the group). Unused
keyword arguments are ignored so the trainer can pass one config dict to whichever estimator is
selected. The advantage is broadcast to every response token by the policy loss.
See ALGORITHMS.md section 1.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from mmrl.registry import register

__all__ = ["grpo", "rloo", "dr_grpo"]


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
