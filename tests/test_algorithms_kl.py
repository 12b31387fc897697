"""KL estimators (values, gradients, straight-through), reward-side KL and the KL controllers."""
from __future__ import annotations

import pytest
import torch

from mmrl.algorithms import (
    KL_KINDS,
    AdaptiveKLController,
    FixedKLController,
    kl_estimate,
    kl_in_reward,
    kl_token_rewards,
)

ATOL = 1e-5
NAN = float("nan")


def close(a: torch.Tensor, b) -> None:
    torch.testing.assert_close(a, torch.as_tensor(b, dtype=a.dtype), atol=ATOL, rtol=0)


# δ = lp - ref = [0.5, -0.5, masked]
#   k1 = δ                 = [0.5, -0.5]           ∂/∂lp = 1
#   abs = |δ|              = [0.5, 0.5]            ∂/∂lp = sign δ
#   k2 = δ²/2              = [0.125, 0.125]        ∂/∂lp = δ
#   k3 = e^{-δ} - 1 + δ    = [e^-0.5 - 0.5, e^0.5 - 1.5] = [0.106531, 0.148721]
#                                                  ∂/∂lp = 1 - e^{-δ} = [0.393469, -0.648721]
CASES = {
    "k1": ([0.5, -0.5], [1.0, 1.0]),
    "abs": ([0.5, 0.5], [1.0, -1.0]),
    "k2": ([0.125, 0.125], [0.5, -0.5]),
    "k3": ([0.106531, 0.148721], [0.393469, -0.648721]),
    # "+": forward value of the estimator, gradient of k2 (δ)
    "k1+": ([0.5, -0.5], [0.5, -0.5]),
    "abs+": ([0.5, 0.5], [0.5, -0.5]),
    "k2+": ([0.125, 0.125], [0.5, -0.5]),
    "k3+": ([0.106531, 0.148721], [0.5, -0.5]),
}


@pytest.mark.parametrize("kind", list(CASES))
def test_estimators_by_hand(kind: str) -> None:
    value, grad = CASES[kind]
    lp = torch.tensor([[0.5, -0.5, NAN]], requires_grad=True)
    kl = kl_estimate(lp, torch.tensor([[0.0, 0.0, 0.0]]), kind, torch.tensor([[1, 1, 0]]))
    close(kl.detach(), [value + [0.0]])
    kl.sum().backward()
    close(lp.grad, [grad + [0.0]])  # masked garbage: value 0, gradient 0, no nan


def test_verl_aliases() -> None:
    lp, ref = torch.tensor([[0.5, -0.5]]), torch.zeros(1, 2)
    for alias, kind in [("kl", "k1"), ("mse", "k2"), ("low_var_kl", "k3"), ("low_var_kl+", "k3+")]:
        close(kl_estimate(lp, ref, alias), kl_estimate(lp, ref, kind))
    assert {"k1", "k2", "k3", "k3+", "low_var_kl"} <= set(KL_KINDS)
    with pytest.raises(ValueError, match="k3"):
        kl_estimate(lp, ref, "full")


def test_k3_clamps_and_no_mask() -> None:
    # δ = -30 -> clamped to -20: e^20 - 21 -> value clamped to 10 ; δ = +30 -> e^-20 + 19 -> 10
    kl = kl_estimate(torch.tensor([[-30.0, 30.0]]), torch.zeros(1, 2), "k3")
    close(kl, [[10.0, 10.0]])


def test_kl_in_reward_sequence_level() -> None:
    # rewards_BG = [[1, 0]] -> sequences n = 0, 1. Σ_t m·kl = 0.1 + 0.2 = 0.3 ; 0.5 + 0.4 = 0.9
    # r - 0.5·Σ = [1 - 0.15, 0 - 0.45]
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.5, NAN, 0.4]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    out = kl_in_reward(torch.tensor([[1.0, 0.0]]), kl, mask, 0.5)
    assert out.shape == (1, 2)
    close(out, [[0.85, -0.45]])
    with pytest.raises(ValueError, match="rewards"):
        kl_in_reward(torch.tensor([1.0, 0.0, 2.0]), kl, mask, 0.5)


def test_kl_token_rewards() -> None:
    # score on the last valid token, minus 0.5·kl on every valid token:
    #   row 0 (last valid t=1): [-0.05, 1 - 0.1, 0] ; row 1 (last valid t=2): [-0.25, 0, 0 - 0.2]
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.5, NAN, 0.4]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    out = kl_token_rewards(torch.tensor([[1.0, 0.0]]), kl, mask, 0.5)
    close(out, [[-0.05, 0.9, 0.0], [-0.25, 0.0, -0.2]])
    assert not out.requires_grad
    # its token sum is the sequence-level penalty
    close(out.sum(-1), [0.85, -0.45])
    # a sequence without valid tokens gets nothing
    close(kl_token_rewards(torch.tensor([3.0]), torch.ones(1, 2), torch.zeros(1, 2), 0.5), [[0.0, 0.0]])


def test_kl_controllers() -> None:
    assert FixedKLController(0.01).update(5.0, 100) == 0.01
    ctl = AdaptiveKLController(kl_coef=0.1, target_kl=0.1, horizon=100)
    # KL 0.2: error clip(0.2/0.1 - 1, ±0.2) = 0.2 -> β = 0.1·(1 + 0.2·10/100) = 0.102
    assert ctl.update(0.2, 10) == pytest.approx(0.102)
    # KL 0.09: error -0.1 -> β = 0.102·(1 - 0.1·50/100) = 0.0969
    assert ctl.update(0.09, 50) == pytest.approx(0.0969)
