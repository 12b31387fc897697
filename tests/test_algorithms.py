"""Advantage estimators, PPO-clip, aggregation and entropy against hand-computed numbers."""
from __future__ import annotations

import math

import pytest
import torch

from mmrl.algorithms import (
    aggregate,
    aggregate_denominator,
    aggregate_sum,
    dr_grpo,
    entropy_from_logits,
    grpo,
    ppo_clip,
    reinforce_pp,
    reinforce_pp_baseline,
    reinforce_pp_token,
    rloo,
)
from mmrl.registry import resolve

ATOL = 1e-5


def close(a: torch.Tensor, b) -> None:
    torch.testing.assert_close(a, torch.as_tensor(b, dtype=a.dtype), atol=ATOL, rtol=0)


# ------------------------------------------------------------------------------- advantages

def test_registered() -> None:
    assert resolve("advantage", "grpo") is grpo
    assert resolve("advantage", "rloo") is rloo
    assert resolve("advantage", "dr_grpo") is dr_grpo
    assert resolve("advantage", "reinforce_pp_baseline") is reinforce_pp_baseline
    assert resolve("advantage", "reinforce_pp") is reinforce_pp
    assert resolve("policy_loss", "ppo_clip") is ppo_clip


def test_grpo_by_hand() -> None:
    # [1,0,0,1]: mean 0.5, unbiased var = 4*0.25/3 = 1/3, std 0.577350 -> ±0.5/0.577350 = ±0.866025
    # [3,0,0,0]: mean 0.75, var = (2.25² + 3*0.75²)/3 = 6.75/3 = 2.25, std 1.5 -> [1.5,-.5,-.5,-.5]
    # [1,1,1,1]: std 0 -> 0/eps = 0
    r = torch.tensor([[1.0, 0, 0, 1], [3, 0, 0, 0], [1, 1, 1, 1]])
    close(grpo(r), [[0.866025, -0.866025, -0.866025, 0.866025],
                    [1.5, -0.5, -0.5, -0.5],
                    [0, 0, 0, 0]])
    close(grpo(r, norm_by_std=False), [[0.5, -0.5, -0.5, 0.5], [2.25, -0.75, -0.75, -0.75], [0, 0, 0, 0]])


def test_grpo_integer_rewards_and_group_of_one() -> None:
    close(grpo(torch.tensor([[1, 0, 0, 1]])), [[0.866025, -0.866025, -0.866025, 0.866025]])
    for fn in (grpo, rloo, dr_grpo):
        out = fn(torch.tensor([[5.0], [-2.0]]))
        assert out.shape == (2, 1)
        close(out, [[0.0], [0.0]])
    with pytest.raises(ValueError, match="shape"):
        grpo(torch.tensor([1.0, 0.0]))


def test_rloo_and_dr_grpo_by_hand() -> None:
    r = torch.tensor([[1.0, 0, 0, 1], [3, 0, 0, 0]])
    # leave-one-out: 1 - (0+0+1)/3 = 2/3 ; 0 - (1+0+1)/3 = -2/3 ; 3 - 0 = 3 ; 0 - 3/3 = -1
    close(rloo(r), [[2 / 3, -2 / 3, -2 / 3, 2 / 3], [3, -1, -1, -1]])
    close(dr_grpo(r), [[0.5, -0.5, -0.5, 0.5], [2.25, -0.75, -0.75, -0.75]])
    # one signature: extra kwargs from a shared config are ignored
    close(rloo(r, norm_by_std=True, eps=1e-6), rloo(r))
    close(dr_grpo(r, eps=0.1), dr_grpo(r))


def test_reinforce_pp_baseline_by_hand() -> None:
    # centred: [.5,-.5,-.5,.5] and [2.25,-.75,-.75,-.75]; one unbiased std over all 8:
    # Σc² = 4·0.25 + 2.25² + 3·0.75² = 7.75, std = sqrt(7.75/7) = 1.052209
    # -> 0.5/1.052209 = 0.475191, 2.25/1.052209 = 2.138359, 0.75/1.052209 = 0.712786
    r = torch.tensor([[1.0, 0, 0, 1], [3, 0, 0, 0]])
    close(reinforce_pp_baseline(r), [[0.475191, -0.475191, -0.475191, 0.475191],
                                     [2.138359, -0.712786, -0.712786, -0.712786]])
    # a constant group adds zeros (and shrinks the batch std): 12 values, std = sqrt(7.75/11) = 0.839372
    r3 = torch.tensor([[1.0, 0, 0, 1], [3, 0, 0, 0], [2, 2, 2, 2]])
    close(reinforce_pp_baseline(r3)[:, 0], [0.5 / 0.839372, 2.25 / 0.839372, 0.0])
    close(reinforce_pp_baseline(torch.ones(2, 3), unknown=1), torch.zeros(2, 3))
    close(reinforce_pp_baseline(torch.tensor([[4.0]])), [[0.0]])


def test_reinforce_pp_by_hand() -> None:
    # batch baseline: r = [1, 0, 3, 0], mean 1, Σ(r-1)² = 0+1+4+1 = 6, std = sqrt(6/3) = 1.414214
    close(reinforce_pp(torch.tensor([[1.0, 0.0], [3.0, 0.0]])), [[0.0, -0.707107], [1.414214, -0.707107]])
    # a constant group is not zeroed: [[2,2],[0,0]] -> mean 1, std sqrt(4/3) = 1.154701 -> ±0.866025
    close(reinforce_pp(torch.tensor([[2.0, 2.0], [0.0, 0.0]])), [[0.866025] * 2, [-0.866025] * 2])


def test_reinforce_pp_token_returns_and_whitening() -> None:
    # γ = 0.5. row 0 rewards [0, 0, 1] -> returns [0.25, 0.5, 1]; row 1 [0, 2 | pad] -> [1, 2]
    # valid returns [.25, .5, 1, 1, 2]: mean 0.95, unbiased var 1.8/4 = 0.45, std 0.670820
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    close(reinforce_pp_token(rewards, mask, gamma=0.5), [[-1.043498, -0.670820, 0.074536],
                                                         [0.074536, 1.565248, 0.0]])
    # a masked middle token (tool output) passes the return through undiscounted, its reward ignored:
    # returns [0.5, -, 1] -> mean 0.75, std sqrt(0.125) = 0.353553 -> [-0.707107, 0, 0.707107]
    out = reinforce_pp_token(torch.tensor([[0.0, 5.0, 1.0]]), torch.tensor([[1, 0, 1]]), gamma=0.5)
    close(out, [[-0.707107, 0.0, 0.707107]])


# ------------------------------------------------------------------------------- ppo_clip

def _logprobs(ratios, old=-1.0):
    old_BT = torch.full((len(ratios), len(ratios[0])), old)
    lp_BT = (old_BT + torch.log(torch.tensor(ratios))).requires_grad_(True)
    return lp_BT, old_BT


def test_ppo_clip_by_hand() -> None:
    lp, old = _logprobs([[0.5, 1.0, 1.5], [0.5, 1.0, 1.5]])
    adv = torch.tensor([1.0, -1.0])
    mask = torch.ones(2, 3, dtype=torch.bool)
    loss, st = ppo_clip(lp, old, adv, mask)
    # A=+1: ℓ1=-ρ, ℓ2=-clip(ρ,.8,1.2): 0.5 -> max(-0.5,-0.8)=-0.5 ; 1 -> -1 ; 1.5 -> max(-1.5,-1.2)=-1.2 (clipped)
    # A=-1: ℓ1=ρ,  ℓ2=clip(ρ):        0.5 -> max(0.5,0.8)=0.8 (clipped) ; 1 -> 1 ; 1.5 -> max(1.5,1.2)=1.5
    close(loss, [[-0.5, -1.0, -1.2], [0.8, 1.0, 1.5]])
    close(st["ratio_BT"], [[0.5, 1.0, 1.5], [0.5, 1.0, 1.5]])
    assert st["clipped_BT"].tolist() == [[False, False, True], [True, False, False]]
    assert not st["dual_clipped_BT"].any()
    loss.sum().backward()
    # dℓ/dlp = -A·ρ where unclipped, 0 where the clipped branch is active
    close(lp.grad, [[-0.5, -1.0, 0.0], [0.0, 1.0, 1.5]])
    # one config dict for every loss: unknown keywords are ignored
    loss2, _ = ppo_clip(lp, old, adv, mask, clip_low=0.2, clip_high=0.2, weights_BT=None, unknown=1)
    close(loss2.detach(), loss.detach())


def test_ppo_clip_asymmetric_clip_higher() -> None:
    lp, old = _logprobs([[1.25, 1.3, 0.75]])
    loss, st = ppo_clip(lp, old, torch.tensor([1.0]), torch.ones(1, 3), clip_low=0.2, clip_high=0.28)
    # 1.25 < 1.28 inside -> -1.25 ; 1.3 -> -1.28 clipped ; 0.75 (A>0, ratio below range) -> -0.75 unclipped
    close(loss, [[-1.25, -1.28, -0.75]])
    assert st["clipped_BT"].tolist() == [[False, True, False]]


def test_ppo_dual_clip() -> None:
    lp, old = _logprobs([[0.5, 1.5, 4.0], [0.5, 1.5, 4.0]])
    adv = torch.tensor([-1.0, 1.0])
    loss, st = ppo_clip(lp, old, adv, torch.ones(2, 3), dual_clip_c=3.0)
    # A=-1: 0.5 -> 0.8 (ε-clip) ; 1.5 -> 1.5 ; 4.0 -> min(max(4, 1.2), 3·1) = 3 (dual clip)
    # A=+1 is never dual-clipped: 0.5 -> -0.5 ; 1.5 -> -1.2 ; 4.0 -> -1.2
    close(loss, [[0.8, 1.5, 3.0], [-0.5, -1.2, -1.2]])
    assert st["dual_clipped_BT"].tolist() == [[False, False, True], [False, False, False]]
    assert st["clipped_BT"].tolist() == [[True, False, False], [False, True, True]]
    loss.sum().backward()
    close(lp.grad, [[0.0, 1.5, 0.0], [-0.5, 0.0, 0.0]])
    with pytest.raises(ValueError, match="dual_clip_c"):
        ppo_clip(lp, old, adv, torch.ones(2, 3), dual_clip_c=1.0)


def test_ppo_clip_mask_and_garbage_padding() -> None:
    lp = torch.tensor([[-1.0, float("-inf"), float("nan")]], requires_grad=True)
    old = torch.tensor([[-1.0, -2.0, float("-inf")]])
    mask = torch.tensor([[1, 0, 0]])
    loss, st = ppo_clip(lp, old, torch.tensor([2.0]), mask)
    close(loss.detach(), [[-2.0, 0.0, 0.0]])
    loss.sum().backward()
    assert torch.isfinite(lp.grad).all()
    close(lp.grad, [[-2.0, 0.0, 0.0]])
    assert not st["clipped_BT"][0, 1:].any()


def test_ppo_clip_token_level_advantages_and_huge_ratio() -> None:
    lp, old = _logprobs([[1.0, 1.0]])
    loss, _ = ppo_clip(lp, old, torch.tensor([[1.0, -2.0]]), torch.ones(1, 2))
    close(loss, [[-1.0, 2.0]])
    # log-ratio 100 is clamped to 20 before exp: finite
    loss, st = ppo_clip(torch.tensor([[100.0]]), torch.tensor([[0.0]]), torch.tensor([-1.0]), torch.ones(1, 1))
    assert torch.isfinite(loss).all()
    close(st["ratio_BT"], [[math.exp(20.0)]])


# ------------------------------------------------------------------------------- aggregation

LOSS = torch.tensor([[1.0, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]])
MASK = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])  # third row has no valid token


def test_aggregate_modes_by_hand() -> None:
    # valid entries: 1+2 (row 0) and 5+6+7+8=26 (row 1): Σ = 29 over 6 tokens; B = 2 non-empty rows
    close(aggregate(LOSS, MASK, "token_mean"), 29 / 6)
    close(aggregate(LOSS, MASK, "seq_mean_token_sum"), 29 / 2)
    close(aggregate(LOSS, MASK, "seq_mean_token_mean"), (3 / 2 + 26 / 4) / 2)  # = 4.0
    close(aggregate(LOSS, MASK, "seq_mean_token_sum_norm"), 29 / 4)  # default scale = T = 4
    close(aggregate(LOSS, MASK, "seq_mean_token_sum_norm", scale=10.0), 2.9)
    close(aggregate(LOSS, MASK, "token-mean"), 29 / 6)  # verl spelling accepted
    close(aggregate(LOSS, MASK.bool(), "token_mean"), 29 / 6)


def test_aggregate_unknown_mode_lists_modes() -> None:
    with pytest.raises(ValueError) as e:
        aggregate(LOSS, MASK, "mean")
    for m in ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "seq_mean_token_sum_norm"):
        assert m in str(e.value)


def test_aggregate_all_masked_is_zero_not_nan() -> None:
    z = torch.zeros(2, 3)
    for m in ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean", "seq_mean_token_sum_norm"):
        assert aggregate(LOSS[:2, :3], z, m).item() == 0.0
        assert aggregate_denominator(z, m) == (3.0 if m == "seq_mean_token_sum_norm" else 0.0)


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_sum", "seq_mean_token_mean",
                                  "seq_mean_token_sum_norm"])
def test_sum_over_denominator_matches_and_microbatches_share_it(mode: str) -> None:
    num, den = aggregate_sum(LOSS, MASK, mode), aggregate_denominator(MASK, mode)
    close(aggregate(LOSS, MASK, mode), num / den)
    assert den == {"token_mean": 6.0, "seq_mean_token_sum": 2.0, "seq_mean_token_mean": 2.0,
                   "seq_mean_token_sum_norm": 4.0}[mode]
    # micro-batches with different padding: Σ_mb sum_mb / D_global == aggregate of the whole batch
    g = torch.Generator().manual_seed(0)
    loss = torch.randn(6, 5, generator=g)
    mask = (torch.rand(6, 5, generator=g) > 0.4).int()
    mask[2] = 0
    mbs = [(loss[:2], mask[:2]), (loss[2:5, :3], mask[2:5, :3]), (loss[5:], mask[5:])]
    mask_trunc = mask.clone()
    mask_trunc[2:5, 3:] = 0  # what the second micro-batch dropped by its shorter padding
    global_den = aggregate_denominator([m for _, m in mbs], mode, scale=7.0)
    total = sum(aggregate_sum(l, m, mode) for l, m in mbs) / max(global_den, 1.0)
    close(total, aggregate(loss, mask_trunc, mode, scale=7.0))


def test_aggregate_gradient() -> None:
    loss = LOSS.clone().requires_grad_(True)
    aggregate(loss, MASK, "token_mean").backward()
    close(loss.grad, MASK.float() / 6)


# ------------------------------------------------------------------------------- entropy

def test_entropy_uniform_is_log_v() -> None:
    ent = entropy_from_logits(torch.zeros(2, 3, 7))
    assert ent.shape == (2, 3)
    close(ent, torch.full((2, 3), math.log(7)))
    # large shifted logits stay stable
    close(entropy_from_logits(torch.full((1, 1, 5), 1e4)), [[math.log(5)]])


def test_entropy_by_hand_and_masked_vocab() -> None:
    # p = (0.25, 0.75): H = -(0.25 ln 0.25 + 0.75 ln 0.75) = 0.562335
    logits = torch.tensor([[[0.0, math.log(3.0)]]])
    close(entropy_from_logits(logits), [[0.562335]])
    x = torch.tensor([[[0.0, 0.0, float("-inf"), float("-inf")]]], requires_grad=True)
    ent = entropy_from_logits(x)
    close(ent.detach(), [[math.log(2)]])
    ent.sum().backward()
    assert torch.isfinite(x.grad).all()
    assert entropy_from_logits(torch.zeros(1, 2, 4, dtype=torch.bfloat16)).dtype == torch.float32
