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


# Thresholds of the ratio's clip: `loss_fn_config` scalars, or per-token arrays of the same names
# in `loss_fn_inputs` (the SDK declares both), which win.
PPO_THRESHOLDS = (0.8, 1.2)
# GSPO's sequence ratio is a geometric mean, so it moves far less than a token's: the paper's
# clip range is 3e-4 below and 4e-4 above 1 (arXiv 2507.18071, section 5.1).
GSPO_THRESHOLDS = (1.0 - 3e-4, 1.0 + 4e-4)
DRO_BETA = 0.05  # the beta of Tinker's DRO example; `loss_fn_config={"beta": ...}` sets it


def _thresholds(inputs: dict[str, Tensor], config: dict, T: int, where: str,
                defaults: tuple[float, float]) -> tuple[Tensor, Tensor]:
    bounds = []
    for key, default in zip(("clip_low_threshold", "clip_high_threshold"), defaults):
        if key in inputs:
            bounds.append(_need(inputs, key, T, where))
        else:
            bounds.append(torch.full((T,), float(config.get(key, default))))
    low, high = bounds
    if not bool(((0 <= low) & (low <= 1) & (1 <= high)).all()):
        raise LossInputError(f"{where}: need 0 <= clip_low_threshold <= 1 <= clip_high_threshold, got "
                             f"{low.min().item()}..{low.max().item()} and {high.min().item()}..{high.max().item()}",
                             "loss_fn_config.clip_low_threshold")
    return low, high


def ppo(logp_T: Tensor, inputs: dict[str, Tensor], config: dict, where: str) -> Tensor:
    ratio, adv = _ratio(logp_T, inputs, where)
    low, high = _thresholds(inputs, config, logp_T.numel(), where, PPO_THRESHOLDS)
    return -torch.minimum(ratio * adv, torch.clamp(ratio, low, high) * adv)


def cispo(logp_T: Tensor, inputs: dict[str, Tensor], config: dict, where: str) -> Tensor:
    ratio, adv = _ratio(logp_T, inputs, where)
    low, high = _thresholds(inputs, config, logp_T.numel(), where, PPO_THRESHOLDS)
    return -torch.clamp(ratio, low, high).detach() * logp_T * adv


def gspo(logp_T: Tensor, inputs: dict[str, Tensor], config: dict, where: str) -> Tensor:
    """GSPO-token: every token carries the sequence ratio s = exp(mean log(p/q)) over the tokens
    `sequence_ratio_mask` marks (default: those with a non-zero advantage, i.e. the sampled
    ones in RL data), with the gradient of its own logprob; PPO's clipped objective on top."""
    T = logp_T.numel()
    sampler = _need(inputs, "logprobs", T, where)
    adv = _need(inputs, "advantages", T, where)
    if "sequence_ratio_mask" in inputs:
        in_ratio = _need(inputs, "sequence_ratio_mask", T, where) != 0
    else:
        in_ratio = adv != 0
    if not bool(in_ratio.any()):  # nothing sampled to weigh: the datum adds no loss
        return logp_T * 0.0
    log_s = (logp_T.detach() - sampler)[in_ratio].mean().clamp(-20.0, 20.0)
    ratio = torch.exp(log_s + logp_T - logp_T.detach())
    low, high = _thresholds(inputs, config, T, where, GSPO_THRESHOLDS)
    return -torch.minimum(ratio * adv, torch.clamp(ratio, low, high) * adv)


def dro(logp_T: Tensor, inputs: dict[str, Tensor], config: dict, where: str) -> Tensor:
    """DRO: -(log p * A - beta/2 * (log p - log q)^2), a quadratic pull towards the sampler."""
    T = logp_T.numel()
    sampler = _need(inputs, "logprobs", T, where)
    adv = _need(inputs, "advantages", T, where)
    beta = float(config.get("beta", DRO_BETA))
    if beta < 0:
        raise LossInputError(f"loss_fn_config.beta must be >= 0, got {beta}", "loss_fn_config.beta")
    return -(logp_T * adv - 0.5 * beta * (logp_T - sampler) ** 2)


LOSSES: dict[str, Callable[[Tensor, dict[str, Tensor], dict, str], Tensor]] = {
    "cross_entropy": cross_entropy,
    "importance_sampling": importance_sampling,
    "ppo": ppo,
    "cispo": cispo,
    "gspo": gspo,
    "dro": dro,
}
# Named by the SDK, not served here; the 400 says why.
NOT_SUPPORTED = {
    "stable_reinforce": "it needs sampling-time stability records (`record_stability_info`, sequence ids), "
                        "which tinker 0.38 cannot request",
    "custom": "server-side custom loss graphs are not supported; `forward_backward_custom(data, fn)` with a "
              "Python loss works (it runs as cross_entropy with the loss's gradient as weights)",
}


def check_loss_name(loss_fn: str) -> None:
    """Raise LossInputError (field `loss_fn`) unless this server implements `loss_fn`."""
    if loss_fn in LOSSES:
        return
    why = f" ({NOT_SUPPORTED[loss_fn]})" if loss_fn in NOT_SUPPORTED else ""
    raise LossInputError(f"loss_fn {loss_fn!r} is not supported{why}; supported: {', '.join(LOSSES)}", "loss_fn")
