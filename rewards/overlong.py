"""DAPO overlong reward shaping (arXiv 2503.14476; verl `reward_model.overlong_buffer`).

With L_max = max_length and L_cache = cache_length, a response of |y| tokens gets

    R_len = 0                                   if |y| <= L_max - L_cache
          = ((L_max - L_cache) - |y|) / L_cache  otherwise, floored at -1 (reached at |y| = L_max)

times `penalty_factor`. It is a penalty only: add it beside a correctness reward, e.g.

    rewards:
      - {name: math_answer, weight: 1.0}
      - {name: dapo_overlong, weight: 1.0, args: {max_length: 1024, cache_length: 256}}

Set max_length to the rollout's max new tokens (`rollout.max_new_tokens`); the length is the number
of response token ids (`response_ids`).
"""
from __future__ import annotations

from typing import Any, Sequence

from mmrl.registry import register

__all__ = ["dapo_overlong", "overlong_penalty"]


def overlong_penalty(length: int, max_length: int, cache_length: int, penalty_factor: float = 1.0) -> float:
    """R_len for a response of `length` tokens (see the module docstring); in [-penalty_factor, 0]."""
    if max_length <= 0 or cache_length <= 0 or cache_length > max_length:
        raise ValueError(f"dapo_overlong: need 0 < cache_length <= max_length, got "
                         f"max_length={max_length}, cache_length={cache_length}")
    if penalty_factor < 0:
        raise ValueError(f"dapo_overlong: penalty_factor must be >= 0, got {penalty_factor}")
    exceed = length - (max_length - cache_length)
    if exceed <= 0:
        return 0.0
    return -penalty_factor * min(1.0, exceed / cache_length)


@register("reward", "dapo_overlong")
def dapo_overlong(response: str, response_ids: Sequence[int] | None, *, max_length: int, cache_length: int,
                  penalty_factor: float = 1.0) -> dict[str, float]:
    """DAPO soft overlong penalty: 0 up to max_length − cache_length tokens, then linearly down
    to −penalty_factor at max_length (and beyond). Components: length (tokens), overlong (1 if
    the penalty applies), truncated (1 if length >= max_length)."""
    ids: Any = response_ids if response_ids is not None else []
    length = len(ids)
    if length == 0 and response:
        raise ValueError("dapo_overlong needs the response token ids (response_ids), but the caller "
                         "passed none for a non-empty response")
    score = overlong_penalty(length, int(max_length), int(cache_length), float(penalty_factor))
    return {"score": score, "length": float(length),
            "overlong": 1.0 if length > max_length - cache_length else 0.0,
            "truncated": 1.0 if length >= max_length else 0.0}
