"""Step schedules shared by the learning rate (trainer.lr_schedule) and the entropy bonus
(algorithm.entropy_schedule): hold a start value, then move to an end value over `steps`.

  constant  the start value throughout
  linear    start value until `start_step`, then a straight line to the end value over `steps`
  cosine    the same along a half cosine (gentle at both ends)

A value is a function of the step only, so a resumed run uses exactly the values the
uninterrupted run would have used.
"""
from __future__ import annotations

import math

SCHEDULE_KINDS = ("constant", "linear", "cosine")


def scheduled(step: int, start: float, end: float, kind: str = "constant", start_step: int = 0,
              steps: int = 0) -> float:
    """The value at training step `step` (1-based)."""
    if kind not in SCHEDULE_KINDS:
        raise ValueError(f"unknown schedule {kind!r}; choose one of {', '.join(SCHEDULE_KINDS)}")
    if kind == "constant" or step <= start_step:
        return float(start)
    if steps <= 0 or step >= start_step + steps:
        return float(end)
    progress = (step - start_step) / steps
    if kind == "cosine":
        progress = 0.5 * (1.0 - math.cos(math.pi * progress))
    return float(start + (end - start) * progress)


def warmup_factor(step: int, warmup_steps: int) -> float:
    """Linear warm-up: step/warmup_steps for the first warmup_steps steps, then 1."""
    return 1.0 if warmup_steps <= 0 or step >= warmup_steps else max(step, 1) / warmup_steps
