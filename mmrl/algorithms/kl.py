"""KL(π_θ‖π_ref) estimators per token and the two places a KL penalty can go.

With δ = log π_θ − log π_ref on tokens sampled from π_θ (Schulman's estimators):
    k1 = δ                 unbiased, can be negative                (verl "kl")
    abs = |δ|                                                       (verl "abs")
    k2 = ½ δ²              biased, low variance                      (verl "mse")
    k3 = e^{−δ} − 1 + δ    unbiased and ≥ 0; δ clamped to ±20 and the value to ±10 (verl "low_var_kl")
A "+" suffix (k1+, abs+, k3+) has the forward value of that estimator and the gradient of k2:
only k2's gradient is an unbiased estimate of ∇KL(π_θ‖π_ref) when used as a loss (k1's has zero
mean, k3's estimates the forward KL). k2+ is k2.

In the loss (GRPO style; verl actor.use_kl_loss, kl_loss_type=low_var_kl, coef 0.001):
    kl_BT = kl_estimate(logprobs_BT, ref_logprobs_BT, "k3", mask_BT)
    loss  = aggregate(pg_loss_BT, mask) + coef · aggregate(kl_BT, mask)   # same agg mode as the policy loss
In the reward (PPO/InstructGPT style; verl algorithm.use_kl_in_reward, kl_penalty "kl" = k1), with
old (rollout-time) logprobs and no gradient: per token r_t = score_t − β·kl_t (`kl_token_rewards`,
for token-level estimators such as reinforce_pp_token / GAE), or per sequence r − β·Σ_t kl_t
(`kl_in_reward`, for the group estimators that take one reward per response). β may be adapted
with `AdaptiveKLController`.
"""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["kl_estimate", "sequence_kl", "kl_in_reward", "kl_token_rewards", "KL_KINDS", "FixedKLController",
           "AdaptiveKLController"]

_ALIASES = {"kl": "k1", "k1": "k1", "abs": "abs", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3"}
KL_KINDS = tuple(sorted(set(_ALIASES) | {a + "+" for a in _ALIASES}))

# verl low_var_kl: clamp the log-ratio before exp() and the estimate after it.
K3_LOG_RATIO_CLAMP = 20.0
K3_VALUE_CLAMP = 10.0


def _canonical(kind: str) -> tuple[str, bool]:
    straight_through = kind.endswith("+")
    base = _ALIASES.get(kind[:-1] if straight_through else kind)
    if base is None:
        raise ValueError(f"unknown KL estimator {kind!r}; kinds are: {', '.join(KL_KINDS)}")
    return base, straight_through


def _forward(delta_BT: Tensor, base: str) -> Tensor:
    if base == "k1":
        return delta_BT
    if base == "abs":
        return delta_BT.abs()
    if base == "k2":
        return 0.5 * delta_BT.square()
    d = delta_BT.clamp(-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)
    return (torch.exp(-d) - 1.0 + d).clamp(-K3_VALUE_CLAMP, K3_VALUE_CLAMP)


def kl_estimate(logprobs_BT: Tensor, ref_logprobs_BT: Tensor, kind: str = "k3",
                mask_BT: Tensor | None = None) -> Tensor:
    """Per-token KL estimate kl_BT of kind k1|abs|k2|k3 (or verl's names), optionally with "+".

    Gradients flow into both arguments as given (detach the reference yourself if it is not
    already). Masked positions are 0 and carry no gradient, even if their logprobs are inf/nan.
    """
    base, straight_through = _canonical(kind)
    if logprobs_BT.shape != ref_logprobs_BT.shape:
        raise ValueError(f"shape mismatch: logprobs {tuple(logprobs_BT.shape)}, "
                         f"ref {tuple(ref_logprobs_BT.shape)}")
    delta_BT = logprobs_BT - ref_logprobs_BT
    valid_BT = None
    if mask_BT is not None:
        if mask_BT.shape != logprobs_BT.shape:
            raise ValueError(f"mask {tuple(mask_BT.shape)} does not match logprobs {tuple(logprobs_BT.shape)}")
        valid_BT = mask_BT if mask_BT.dtype == torch.bool else mask_BT > 0
        delta_BT = torch.where(valid_BT, delta_BT, torch.zeros_like(delta_BT))
    kl_BT = _forward(delta_BT, base)
    if straight_through and base != "k2":
        k2_BT = 0.5 * delta_BT.square()
        kl_BT = kl_BT.detach() + (k2_BT - k2_BT.detach())
    if valid_BT is not None:
        kl_BT = torch.where(valid_BT, kl_BT, torch.zeros_like(kl_BT))
    return kl_BT


def _valid(kl_BT: Tensor, mask_BT: Tensor) -> Tensor:
    if mask_BT.shape != kl_BT.shape:
        raise ValueError(f"mask {tuple(mask_BT.shape)} does not match kl {tuple(kl_BT.shape)}")
    return mask_BT if mask_BT.dtype == torch.bool else mask_BT > 0


def kl_in_reward(rewards: Tensor, kl_BT: Tensor, mask_BT: Tensor, coef: float) -> Tensor:
    """Sequence-level reward penalty: r_n − coef · Σ_t m·kl_{n,t}, detached.

    `rewards` holds one reward per sequence in any shape (e.g. rewards_BG) whose row-major order
    is the row order n of kl_BT (sequence n = b·G + g). The result has the shape of `rewards`.
    Equals the sum over tokens of `kl_token_rewards`.
    """
    valid_BT = _valid(kl_BT, mask_BT)
    if rewards.numel() != kl_BT.shape[0]:
        raise ValueError(f"{rewards.numel()} rewards for {kl_BT.shape[0]} sequences of kl")
    kl_sum_N = torch.where(valid_BT, kl_BT.detach(), torch.zeros_like(kl_BT)).sum(dim=-1)
    r = rewards if rewards.is_floating_point() else rewards.float()
    return r - coef * kl_sum_N.reshape(r.shape).to(r.dtype)


def kl_token_rewards(scores_N: Tensor, kl_BT: Tensor, mask_BT: Tensor, coef: float) -> Tensor:
    """Per-token rewards r_t = score·1[t = last valid token] − coef·kl_t (verl apply_kl_penalty).

    scores_N: one outcome score per sequence (any shape with N = kl_BT.shape[0] elements,
    row-major). Returns token_rewards_BT, detached, 0 at masked positions. A sequence without
    valid tokens gets all zeros (its score has nowhere to go).
    """
    valid_BT = _valid(kl_BT, mask_BT)
    if scores_N.numel() != kl_BT.shape[0]:
        raise ValueError(f"{scores_N.numel()} scores for {kl_BT.shape[0]} sequences of kl")
    kl = kl_BT.detach() if kl_BT.is_floating_point() else kl_BT.float()
    zeros_BT = torch.zeros_like(kl)
    scores_BT = scores_N.reshape(-1, 1).to(kl.dtype).expand_as(kl)
    t_idx = torch.arange(kl.shape[1], device=kl.device).expand_as(kl)
    last_N = torch.where(valid_BT, t_idx, torch.full_like(t_idx, -1)).max(dim=-1).values
    is_last_BT = (t_idx == last_N.unsqueeze(-1)) & valid_BT
    penalty_BT = torch.where(valid_BT, coef * kl, zeros_BT)
    return torch.where(is_last_BT, scores_BT, zeros_BT) - penalty_BT


class FixedKLController:
    """β stays at its initial value (verl kl_ctrl.type=fixed)."""

    def __init__(self, kl_coef: float = 0.001) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> float:
        return self.value


class AdaptiveKLController:
    """β ← β·(1 + clip(KL/target − 1, ±0.2)·n/horizon) (Ziegler et al.; verl kl_ctrl.type=adaptive).

    `current_kl` is the batch's mean per-sequence KL, `n_steps` the number of sequences in it.
    The ±0.2 clip bounds how fast β moves when the KL is far from target.
    """

    def __init__(self, kl_coef: float = 0.001, target_kl: float = 0.1, horizon: int = 10000) -> None:
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(f"target_kl and horizon must be > 0; got {target_kl}, {horizon}")
        self.value = float(kl_coef)
        self.target = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> float:
        error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
        return self.value


def sequence_kl(logprobs: list[float], ref_logprobs: list[float], mask: list[int], kind: str) -> float:
    """Σ_t KL_t over one response's trained tokens (KL in the reward, per sequence); the "+"
    suffix only changes gradients, so it is ignored here."""
    if not mask:
        return 0.0
    kl_1T = kl_estimate(torch.tensor([logprobs], dtype=torch.float32), torch.tensor([ref_logprobs], dtype=torch.float32),
                        kind.rstrip("+"))
    return float((kl_1T * torch.tensor([mask], dtype=torch.float32)).sum())
