"""The entropy bonus's coefficient over training (algorithm.entropy_schedule).

An entropy bonus helps a policy explore while it is still learning, but it never switches itself
off: once every group is solved the advantages are ~0, and the bonus is then the only force on
the weights. It keeps raising the entropy step after step until the policy drifts off the
answers it had learned (the default demo, held at a constant 0.1, lost a class after ~450
solved steps). A schedule (mmrl/utils/schedule.py: constant, linear, cosine) hands the bonus
back once learning is done.
"""
from __future__ import annotations

from mmrl.utils.schedule import SCHEDULE_KINDS, scheduled

__all__ = ["entropy_coef_at", "SCHEDULE_KINDS"]


def entropy_coef_at(step: int, coef: float, kind: str = "constant", start_step: int = 0, steps: int = 0,
                    end_coef: float = 0.0) -> float:
    """The entropy coefficient used by training step `step` (1-based)."""
    return scheduled(step, coef, end_coef, kind, start_step, steps)
