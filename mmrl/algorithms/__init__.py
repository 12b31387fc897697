"""Algorithms: advantage estimators, policy losses + aggregation, KL, rollout correction, DAPO.

advantages.py and losses.py/gspo.py register themselves with mmrl.registry ("advantage",
"policy_loss") on import, so configs name them (`grpo`, `ppo_clip`, `gspo`) or point at user code
(`my_pkg.algos:my_adv`). The registry imports mmrl.algorithms.losses, which runs this package
init first: importing gspo here is what registers the GSPO losses.
"""
from mmrl.algorithms.advantages import (
    dr_grpo,
    grpo,
    reinforce_pp,
    reinforce_pp_baseline,
    reinforce_pp_token,
    rloo,
)
from mmrl.algorithms.correction import CORRECTION_LEVELS, CORRECTION_MODES, rollout_correction
from mmrl.algorithms.dynamic_sampling import GroupAccumulator, informative_groups
from mmrl.algorithms.gspo import GSPO_AGG_MODE, gspo, gspo_token
from mmrl.algorithms.kl import (
    KL_KINDS,
    AdaptiveKLController,
    FixedKLController,
    kl_estimate,
    kl_in_reward,
    kl_token_rewards,
)
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
    "grpo", "rloo", "dr_grpo", "reinforce_pp_baseline", "reinforce_pp", "reinforce_pp_token",
    "ppo_clip", "gspo", "gspo_token", "GSPO_AGG_MODE",
    "aggregate", "aggregate_sum", "aggregate_denominator", "entropy_from_logits", "AGG_MODES", "ADDITIVE_MODES",
    "kl_estimate", "kl_in_reward", "kl_token_rewards", "KL_KINDS", "FixedKLController", "AdaptiveKLController",
    "rollout_correction", "CORRECTION_MODES", "CORRECTION_LEVELS",
    "informative_groups", "GroupAccumulator",
]
