"""Built-in reward plugins (installed as `mmrl.plugins.rewards`).

Importing this package registers them: answer_match, first_word_in, shape_colour, multiple_choice,
math_answer, format_tags, grounding_iou, counting, ocr_edit_distance, temporal_iou, dapo_overlong,
tool_success, final_answer, and the model-based clip_score and vlm_judge (docs/rewards.md has a
table of them and their arguments). A new reward is one file here, or anywhere a config can name
(`mmrl new reward NAME` writes one with its contract test); the calling convention and the
workers that run rewards are in mmrl/rewards/.
"""
from mmrl.plugins.rewards import (answer, choice, clip_score, colour, counting, final_answer,  # noqa: F401
                                  format_tags, grounding, math_answer, ocr, overlong, temporal, tool_state,
                                  vlm_judge)  # (importing registers the built-ins)
