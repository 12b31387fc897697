"""Small helpers shared across stages."""
from __future__ import annotations

from typing import Sequence, TypeVar

T = TypeVar("T")


def split_even(items: Sequence[T], parts: int) -> list[list[T]]:
    """Contiguous near-equal parts, in order (some are empty when len(items) < parts)."""
    base, extra = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        out.append(list(items[start:end]))
        start = end
    return out
