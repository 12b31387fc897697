"""Reward execution: the calling convention (base.py, calling.py, variants.py), the scorer and the
isolated reward workers (scorer.py, workers.py, pool.py, streaming.py).

The built-in rewards are plugins in the repository's top-level `rewards/` folder (imported as
`mmrl.plugins.rewards`; docs/rewards.md has a table of them and their arguments). Write your own
as a plain function taking keyword arguments, e.g.
`def iou(response: str, answer, images, **_) -> float | dict`, `async def` if it waits on I/O, or
`@reward(batched=True)` to score a whole group per call; name it in the config as
`my_pkg.rewards:iou` or `path/to/file.py:iou`.
"""
from mmrl.rewards.base import AVAILABLE_KEYS, RewardError, RewardSet, call_reward, reward_kwargs
from mmrl.rewards.variants import RewardTraits, reward, traits_of

__all__ = ["AVAILABLE_KEYS", "RewardError", "RewardSet", "RewardTraits", "call_reward", "reward",
           "reward_kwargs", "traits_of"]
