"""The three ways a reward can be written, and the decorator that declares them.

    def plain(response, answer, **_) -> float | dict                # one response per call
    async def remote(response, **_) -> float | dict                 # awaited, a group's calls run concurrently
    @reward(batched=True)
    def model(response: list[str], images: list[list], **_) -> list[float | dict]   # a group per call

A *batched* reward receives the same keywords as a plain one, but every reward keyword
(`response`, `images`, `answer`, ...; see `AVAILABLE_KEYS`) is a list with one entry per
response, in order; the entry's config `args` stay single values. It returns one float or dict
per response. `async def` is detected by itself; `batched` has to be declared, because a
function's signature cannot say whether `response` is one string or a list of them.

`setup` (optional) is called once per process with the entry's args it declares, before any
scoring and outside the per-call timeout: the place to load a model so the first timed call
does not pay for it (the reward workers call it at start; in-process scoring on first use).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable

from mmrl.registry import register

__all__ = ["RewardTraits", "reward", "traits_of"]

_ATTR = "__mmrl_reward__"


@dataclass(frozen=True)
class RewardTraits:
    """How the scorer calls a reward."""

    batched: bool = False
    is_async: bool = False
    # async per-response rewards: at most this many calls of one group in flight (None: all)
    max_concurrency: int | None = None
    setup: Callable[..., Any] | None = None


def reward(name: str | None = None, *, batched: bool = False, max_concurrency: int | None = None,
           setup: Callable[..., Any] | None = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Declare a reward's calling convention; with a `name`, also register it (kind "reward").

    `@reward(batched=True)` alone only marks the function (for a reward named by path in the
    config); `@reward("clip_score", batched=True)` marks and registers it.
    """
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1 or None, got {max_concurrency}")

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        if not callable(fn):
            raise TypeError(f"@reward expects a function, got {fn!r}")
        setattr(fn, _ATTR, RewardTraits(batched=batched, is_async=inspect.iscoroutinefunction(fn),
                                        max_concurrency=max_concurrency, setup=setup))
        return register("reward", name)(fn) if name else fn

    return deco


def traits_of(fn: Any) -> RewardTraits:
    """The declared traits, or those of a plain function (async detected from the definition)."""
    traits = getattr(fn, _ATTR, None)
    if isinstance(traits, RewardTraits):
        return traits
    call = getattr(fn, "__call__", None)
    is_async = inspect.iscoroutinefunction(fn) or (
        not inspect.isfunction(fn) and call is not None and inspect.iscoroutinefunction(call))
    return RewardTraits(is_async=is_async)
