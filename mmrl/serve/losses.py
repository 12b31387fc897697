"""The Tinker built-in losses, on one datum's per-token logprobs.

Tinker's losses are token-wise and SUMMED (no normalisation; the client scales advantages or
weights itself), reported as the metric `loss:sum`. Each function takes the datum's logprobs of
its target tokens under the current weights (`logp_T`, with grad) and its `loss_fn_inputs` as
float tensors, and returns the per-token loss (`elementwise_loss`).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor


class LossInputError(ValueError):
    """A loss input that is missing or of the wrong length (answered 400, naming `field`)."""

    def __init__(self, message: str, field: str):
        super().__init__(message)
        self.field = field


def _need(inputs: dict[str, Tensor], key: str, T: int, where: str) -> Tensor:
    if key not in inputs:
        raise LossInputError(f"{where}.loss_fn_inputs.{key} is required by this loss", f"{where}.loss_fn_inputs.{key}")
    x = inputs[key].reshape(-1)
    if x.numel() != T:
        raise LossInputError(f"{where}.loss_fn_inputs.{key} has {x.numel()} values, the target has {T}",
                             f"{where}.loss_fn_inputs.{key}")
    return x.float()


def cross_entropy(logp_T: Tensor, inputs: dict[str, Tensor], config: dict, where: str) -> Tensor:
    weights = _need(inputs, "weights", logp_T.numel(), where) if "weights" in inputs else torch.ones_like(logp_T)
    return -weights * logp_T


def _ratio(logp_T: Tensor, inputs: dict[str, Tensor], where: str) -> tuple[Tensor, Tensor]:
    T = logp_T.numel()
    sampler = _need(inputs, "logprobs", T, where)
    adv = _need(inputs, "advantages", T, where)
    # clamped in log space: a stale sample must not overflow the ratio
    return torch.exp(torch.clamp(logp_T - sampler, -20.0, 20.0)), adv


def importance_sampling(logp_T: Tensor, inputs: dict[str, Tensor], config: dict, where: str) -> Tensor:
    ratio, adv = _ratio(logp_T, inputs, where)
    return -ratio * adv


def _thresholds(config: dict) -> tuple[float, float]:
    low = float(config.get("clip_low_threshold", 0.8))
    high = float(config.get("clip_high_threshold", 1.2))
    if not 0 <= low <= 1 <= high:
        raise LossInputError(f"loss_fn_config: need 0 <= clip_low_threshold <= 1 <= clip_high_threshold, "
                             f"got {low} and {high}", "loss_fn_config.clip_low_threshold")
    return low, high


def ppo(logp_T: Tensor, inputs: dict[str, Tensor], config: dict, where: str) -> Tensor:
    ratio, adv = _ratio(logp_T, inputs, where)
    low, high = _thresholds(config)
    return -torch.minimum(ratio * adv, torch.clamp(ratio, low, high) * adv)


def cispo(logp_T: Tensor, inputs: dict[str, Tensor], config: dict, where: str) -> Tensor:
    ratio, adv = _ratio(logp_T, inputs, where)
    low, high = _thresholds(config)
    return -torch.clamp(ratio, low, high).detach() * logp_T * adv


LOSSES: dict[str, Callable[[Tensor, dict[str, Tensor], dict, str], Tensor]] = {
    "cross_entropy": cross_entropy,
    "importance_sampling": importance_sampling,
    "ppo": ppo,
    "cispo": cispo,
}
# Named by the SDK, not implemented by this server yet: answered 400 with this list.
NOT_YET = ("gspo", "dro", "stable_reinforce", "custom")
