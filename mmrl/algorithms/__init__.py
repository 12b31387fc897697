"""Algorithms: advantage estimators (advantages.py) and policy losses + aggregation (losses.py).

Both register themselves with mmrl.registry ("advantage", "policy_loss") on import, so configs
name them (`grpo`, `ppo_clip`) or point at user code (`my_pkg.algos:my_adv`).
"""
from mmrl.algorithms.advantages import dr_grpo, grpo, rloo
from mmrl.algorithms.losses import (
    ADDITIVE_MODES,
    AGG_MODES,
    aggregate,
    aggregate_denominator,
    aggregate_sum,
    entropy_from_logits,
    ppo_clip,
)

__all__ = [
    "grpo", "rloo", "dr_grpo", "ppo_clip", "aggregate", "aggregate_sum", "aggregate_denominator",
    "entropy_from_logits", "AGG_MODES", "ADDITIVE_MODES",
]
