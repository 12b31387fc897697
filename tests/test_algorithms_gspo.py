"""GSPO and GSPO-token against hand-computed sequence ratios, losses and gradients."""
from __future__ import annotations

import math

import torch

from mmrl.algorithms import aggregate, gspo, gspo_token
from mmrl.registry import resolve

ATOL = 1e-5
NAN, NEG_INF = float("nan"), float("-inf")


def close(a: torch.Tensor, b) -> None:
    torch.testing.assert_close(a, torch.as_tensor(b, dtype=a.dtype), atol=ATOL, rtol=0)


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # old = 0, so lp is the token log-ratio; garbage (nan, -inf) at masked positions.
    lp = torch.tensor([[0.1, -0.1, NAN],      # mean 0    -> s = 1,                    A = +2
                       [0.3, 0.1, 0.2],       # mean 0.2  -> s = e^0.2  = 1.221403,    A = +1 (clipped)
                       [-0.3, -0.1, NEG_INF],  # mean -0.2 -> s = e^-0.2 = 0.818731,   A = +1
                       [0.2, 0.2, 0.2]],      # mean 0.2  -> s = 1.221403,             A = -1
                      requires_grad=True)
    old = torch.zeros(4, 3)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 1, 0], [1, 1, 1]])
    adv = torch.tensor([2.0, 1.0, 1.0, -1.0])
    return lp, old, adv, mask


# ε_low = 3e-4, ε_high = 4e-4 (defaults). ℓ_i = max(-A s, -A clip(s, 0.9997, 1.0004)):
#   row 0: -2 ; row 1: max(-1.221403, -1.0004) = -1.0004 (clipped) ;
#   row 2: max(-0.818731, -0.9997) = -0.818731 ; row 3: max(1.221403, 1.0004) = 1.221403
LOSS_ROWS = [-2.0, -1.0004, -0.818731, 1.221403]
# seq_mean_token_mean = (1/4) Σ_i ℓ_i = (-2 - 1.0004 - 0.818731 + 1.221403) / 4
OBJECTIVE = -0.649432
# ∂J/∂lp_{i,t} = (1/B)·(-A_i s_i / |y_i|) where unclipped:
#   row 0: (1/4)(-2·1/2) = -0.25 ; row 1: 0 ; row 2: (1/4)(-0.818731/2) = -0.102341 ;
#   row 3: (1/4)(+1.221403/3) = 0.101784
GRAD = [[-0.25, -0.25, 0.0], [0.0, 0.0, 0.0], [-0.102341, -0.102341, 0.0], [0.101784] * 3]


def test_registered_with_agg_mode() -> None:
    assert resolve("policy_loss", "gspo") is gspo
    assert resolve("policy_loss", "gspo_token") is gspo_token
    assert gspo.agg_mode == gspo_token.agg_mode == "seq_mean_token_mean"


def test_gspo_by_hand() -> None:
    lp, old, adv, mask = _batch()
    loss, st = gspo(lp, old, adv, mask)
    r = LOSS_ROWS
    close(loss.detach(), [[r[0], r[0], 0.0], [r[1]] * 3, [r[2], r[2], 0.0], [r[3]] * 3])
    close(st["ratio_BT"], [[1.0, 1.0, 1.0], [1.221403] * 3, [0.818731, 0.818731, 1.0], [1.221403] * 3])
    assert st["clipped_BT"].tolist() == [[False] * 3, [True] * 3, [False] * 3, [False] * 3]
    assert not st["dual_clipped_BT"].any()
    obj = aggregate(loss, mask, "seq_mean_token_mean")
    close(obj.detach(), OBJECTIVE)
    obj.backward()
    assert torch.isfinite(lp.grad).all()
    close(lp.grad, GRAD)


def test_gspo_token_matches_gspo_value_and_gradient() -> None:
    lp, old, adv, mask = _batch()
    loss, st = gspo_token(lp, old, adv, mask)
    r = LOSS_ROWS
    close(loss.detach(), [[r[0], r[0], 0.0], [r[1]] * 3, [r[2], r[2], 0.0], [r[3]] * 3])
    assert st["clipped_BT"].tolist() == [[False] * 3, [True] * 3, [False] * 3, [False] * 3]
    obj = aggregate(loss, mask, "seq_mean_token_mean")
    close(obj.detach(), OBJECTIVE)
    obj.backward()
    close(lp.grad, GRAD)


def test_gspo_token_per_token_advantages() -> None:
    # s = e^0.2 = 1.221403 on both tokens; ∂s_{i,t}/∂lp_t = s.
    # token 0, A=+1: max(-1.221403, -1.0004) = -1.0004, clipped, grad 0
    # token 1, A=-1: max(1.221403, 1.0004) = 1.221403, grad -A·s = 1.221403
    lp = torch.tensor([[0.3, 0.1]], requires_grad=True)
    loss, st = gspo_token(lp, torch.zeros(1, 2), torch.tensor([[1.0, -1.0]]), torch.ones(1, 2))
    close(loss.detach(), [[-1.0004, 1.221403]])
    assert st["clipped_BT"].tolist() == [[True, False]]
    loss.sum().backward()
    close(lp.grad, [[0.0, 1.221403]])


def test_gspo_token_level_advantages_reduce_to_sequence_mean() -> None:
    lp, old, adv, mask = _batch()
    adv_BT = adv.unsqueeze(-1).repeat(1, 3)
    adv_BT[0, 2] = 999.0  # masked: ignored by the per-sequence mean
    loss_bt, _ = gspo(lp, old, adv_BT, mask)
    loss_b, _ = gspo(lp, old, adv, mask)
    close(loss_bt.detach(), loss_b.detach())


def test_gspo_clip_range_and_clamp() -> None:
    lp, old, adv, mask = _batch()
    # PPO-sized range: row 1 s = 1.221403 > 1.2 -> -1.2 ; row 2 s = 0.818731 > 0.8 -> unclipped
    loss, st = gspo(lp, old, adv, mask, clip_low=0.2, clip_high=0.2, dual_clip_c=3.0, unknown=1)
    close(loss[1].detach(), [-1.2] * 3)
    close(loss[2].detach(), [-0.818731, -0.818731, 0.0])
    # log s = 50 is clamped to 10: s = e^10 = 22026.465795, A=-1 keeps the unclipped branch
    for fn in (gspo, gspo_token):
        big = torch.full((1, 2), 50.0, requires_grad=True)
        loss, st = fn(big, torch.zeros(1, 2), torch.tensor([-1.0]), torch.ones(1, 2))
        close(st["ratio_BT"] / math.exp(10.0), [[1.0, 1.0]])
        loss.sum().backward()
        assert torch.isfinite(loss).all() and torch.isfinite(big.grad).all()


def test_gspo_empty_sequence() -> None:
    lp = torch.tensor([[NAN, NAN], [0.1, 0.1]], requires_grad=True)
    mask = torch.tensor([[0, 0], [1, 1]])
    for fn in (gspo, gspo_token):
        loss, st = fn(lp, torch.zeros(2, 2), torch.tensor([1.0, 1.0]), mask)
        assert torch.all(loss[0] == 0) and not st["clipped_BT"][0].any()
        loss.sum().backward()
        assert torch.isfinite(loss).all() and torch.isfinite(lp.grad).all()
        assert torch.all(lp.grad[0] == 0)
        lp.grad = None
