"""Reward plugins and the reward calling convention (base.py, calling.py, variants.py).

Importing this package registers the built-in rewards: answer_match, first_word_in, shape_colour,
multiple_choice, math_answer, format_tags, grounding_iou, counting, ocr_edit_distance,
temporal_iou, dapo_overlong, and the model-based clip_score and vlm_judge (docs/rewards.md has a
table of them and their arguments). Write your own as a plain function taking keyword arguments,
e.g. `def iou(response: str, answer, images, **_) -> float | dict`, `async def` if it waits on
I/O, or `@reward(batched=True)` to score a whole group per call; name it in the config as
`my_pkg.rewards:iou` or `path/to/file.py:iou`.
"""
from mmrl.rewards import (answer, choice, clip_score, colour, counting, format_tags, grounding,  # noqa: F401
                          math_answer, ocr, overlong, temporal, vlm_judge)  # (importing registers the built-ins)
from mmrl.rewards.base import AVAILABLE_KEYS, RewardError, RewardSet, call_reward, reward_kwargs
from mmrl.rewards.variants import RewardTraits, reward, traits_of

__all__ = ["AVAILABLE_KEYS", "RewardError", "RewardSet", "RewardTraits", "call_reward", "reward",
           "reward_kwargs", "traits_of"]
from mmrl.rewards import tool_state  # noqa: E402,F401  (registers "tool_success")
from mmrl.rewards import final_answer  # noqa: E402,F401  (registers "final_answer")
