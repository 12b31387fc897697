"""Reward plugins and the reward calling convention (base.py).

Importing this package registers the built-in rewards ("answer_match", "shape_colour").
Write your own as a plain function taking keyword arguments, e.g.
`def iou(response: str, answer, images, **_) -> float | dict`, and name it in the config as
`my_pkg.rewards:iou` or `path/to/file.py:iou`.
"""
from mmrl.rewards import answer, colour  # noqa: F401  (register the built-ins)
from mmrl.rewards.base import AVAILABLE_KEYS, RewardError, RewardSet, call_reward, reward_kwargs

__all__ = ["AVAILABLE_KEYS", "RewardError", "RewardSet", "call_reward", "reward_kwargs"]
