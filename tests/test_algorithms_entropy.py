"""Step schedules: the entropy bonus (algorithm.entropy_schedule) and the learning rate
(trainer.lr_schedule), values by hand; the loss uses the entropy coefficient it is given."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from mmrl.algorithms.entropy import entropy_coef_at
from mmrl.algorithms.losses import ppo_clip
from mmrl.trainer.update import LossSettings, micro_batch_loss

REPO = Path(__file__).resolve().parents[1]


def test_constant_ignores_the_other_keys() -> None:
    assert [entropy_coef_at(s, 0.1, "constant", start_step=5, steps=10) for s in (1, 50, 5000)] == [0.1] * 3


def test_linear_holds_then_falls_to_the_end_value() -> None:
    values = {s: entropy_coef_at(s, 0.1, "linear", start_step=150, steps=100, end_coef=0.0)
              for s in (1, 150, 151, 200, 249, 250, 1500)}
    assert values[1] == values[150] == 0.1
    assert values[151] == pytest.approx(0.1 * 0.99)
    assert values[200] == pytest.approx(0.05)
    assert values[249] == pytest.approx(0.001)
    assert values[250] == values[1500] == 0.0
    assert entropy_coef_at(20, 0.1, "linear", start_step=10, steps=0, end_coef=0.02) == 0.02  # steps 0: a switch


def test_cosine_is_gentle_at_both_ends() -> None:
    c = [entropy_coef_at(s, 1.0, "cosine", start_step=0, steps=100, end_coef=0.0) for s in (1, 50, 99)]
    assert c[0] == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.01)))
    assert c[1] == pytest.approx(0.5)
    assert 1 - c[0] == pytest.approx(c[2] - 0.0)  # symmetric around the middle
    with pytest.raises(ValueError, match="unknown schedule .exp."):
        entropy_coef_at(1, 0.1, "exp")


def test_the_coefficient_moves_the_loss_by_exactly_coef_times_entropy() -> None:
    logprobs_BT = torch.log(torch.tensor([[0.5, 0.25]]))
    entropy_BT = torch.tensor([[1.0, 3.0]])
    mask_BT, adv_B = torch.ones(1, 2), torch.tensor([1.0])

    def loss(coef: float) -> float:
        total, _ = micro_batch_loss(ppo_clip, LossSettings(entropy_coef=coef), logprobs_BT, entropy_BT, mask_BT,
                                    adv_B, logprobs_BT, None, None, scale=1.0)
        return float(total)

    # token_mean over 2 tokens: the summed entropy (4.0) enters the numerator, the scale divides later
    assert loss(0.1) - loss(0.0) == pytest.approx(-0.1 * 4.0)


def test_learning_rate_schedule_warmup_decay_and_guard_scale() -> None:
    from mmrl.config import load_config
    from mmrl.controller.train import scheduled_lr

    cfg = load_config(str(REPO / "configs" / "colors_demo.yaml"),
                      ["trainer.lr=1e-3", "trainer.lr_schedule.kind=linear", "trainer.lr_schedule.warmup_steps=4",
                       "trainer.lr_schedule.start_step=10", "trainer.lr_schedule.steps=10",
                       "trainer.lr_schedule.end_factor=0.1"], check_files=False)
    assert scheduled_lr(cfg, 1) == pytest.approx(0.25e-3)  # warm-up 1/4
    assert scheduled_lr(cfg, 4) == scheduled_lr(cfg, 10) == pytest.approx(1e-3)
    assert scheduled_lr(cfg, 15) == pytest.approx(0.55e-3)
    assert scheduled_lr(cfg, 20) == scheduled_lr(cfg, 900) == pytest.approx(1e-4)
    assert scheduled_lr(cfg, 15, lr_scale=0.5) == pytest.approx(0.275e-3)  # after a rollback
    constant = load_config(str(REPO / "configs" / "colors_demo.yaml"), ["trainer.lr_schedule.kind=constant"], check_files=False)
    assert scheduled_lr(constant, 1) == scheduled_lr(constant, 10_000) == constant.trainer.lr
