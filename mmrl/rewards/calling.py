"""Calling a reward: keyword selection, the three variants, and result normalisation.

Every variant (plain, `async def`, batched; see `variants.py`) ends up here. A reward's result
(a float, or a dict with "score" plus numeric components) is normalised to dict[str, float];
anything unusable raises `RewardError` naming the plugin.

    call_reward(fn, **kw)              one response, any variant (a batched reward gets a batch of 1)
    call_batch(fn, items, args, label) a batched reward on many responses: one result per item
    gather_async(fn, items, ...)       an async reward on many responses, concurrently
"""
from __future__ import annotations

import asyncio
import collections.abc
import functools
import inspect
import math
import numbers
import threading
import types
import typing
from typing import Any, Callable, Mapping, Sequence

from mmrl.rewards.variants import traits_of

__all__ = ["AVAILABLE_KEYS", "RewardError", "CallTimeout", "call_reward", "call_single", "call_batch",
           "gather_async", "run_coroutine", "yaml_boolean_problem"]

AVAILABLE_KEYS = ("response", "response_ids", "answer", "images", "videos", "prompt", "messages",
                  "sample", "metadata", "transcript", "tool_state")


class RewardError(RuntimeError):
    """A reward plugin was called wrongly or returned something unusable; names the plugin."""


class CallTimeout(Exception):
    """An async reward call did not finish within its timeout (it was cancelled)."""


def _fn_name(fn: Any) -> str:
    name = getattr(fn, "__qualname__", None) or getattr(type(fn), "__qualname__", repr(fn))
    module = getattr(fn, "__module__", None)
    return f"{module}.{name}" if module else str(name)


@functools.lru_cache(maxsize=512)
def _signature_info(fn: Any) -> tuple[bool, frozenset[str], frozenset[str]]:
    """(takes **kwargs, keyword-passable parameter names, required ones). Cached: hot path."""
    sig = inspect.signature(fn)
    var_kw = False
    names: set[str] = set()
    required: set[str] = set()
    for p in sig.parameters.values():
        if p.kind is p.VAR_KEYWORD:
            var_kw = True
        elif p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            names.add(p.name)
            if p.default is p.empty:
                required.add(p.name)
        elif p.kind is p.POSITIONAL_ONLY and p.default is p.empty:
            required.add(p.name)  # can never be satisfied by keyword: reported as missing
    return var_kw, frozenset(names), frozenset(required)


def _params(fn: Any, label: str) -> tuple[bool, frozenset[str], frozenset[str]]:
    try:
        return _signature_info(fn)
    except TypeError:  # unhashable callable: skip the cache
        return _signature_info.__wrapped__(fn)
    except ValueError as e:  # builtins without a signature
        raise RewardError(f"reward {label!r}: cannot inspect its signature ({e}); wrap it in a "
                          f"Python function that takes keyword arguments") from e


_TEXT_COLLECTIONS = (list, tuple, set, frozenset, collections.abc.Sequence, collections.abc.Iterable,
                     collections.abc.Collection, collections.abc.Set)


def _expects_text(hint: Any) -> bool:
    """str, a collection of str, or an Optional/Union holding one of those."""
    if hint is str:
        return True
    args = typing.get_args(hint)
    if typing.get_origin(hint) in _TEXT_COLLECTIONS:
        return bool(args) and args[0] is str
    return typing.get_origin(hint) in (typing.Union, types.UnionType) and any(_expects_text(a) for a in args)


def yaml_boolean_problem(fn: Any, name: str, value: Any) -> str | None:
    """YAML 1.1 (the config loader's) reads unquoted yes/no/on/off/true/false as booleans, so
    `words: [yes, no]` arrives as [True, False]. When the reward annotates `name` as text (str or a
    collection of str) and `value` holds a bool, the message that says so; else None."""
    try:
        hint = typing.get_type_hints(fn).get(name)
    except Exception:  # a callable object, an unresolvable annotation: nothing to check against
        return None
    if hint is None or not _expects_text(hint):
        return None
    items = list(value) if isinstance(value, Sequence) and not isinstance(value, str) else [value]
    if not any(isinstance(v, bool) for v in items):
        return None
    return (f"arg {name!r} = {value!r} holds a boolean where {_fn_name(fn)} expects text: YAML reads "
            f"unquoted yes/no/on/off/true/false as booleans; quote them in the config "
            f"(e.g. words: [\"yes\", \"no\"])")


def _to_float(x: Any) -> float | None:
    """A plain float from Python/numpy/torch scalars (bool included); None if not a number."""
    if isinstance(x, (str, bytes)):
        return None
    if isinstance(x, numbers.Real):
        return float(x)
    item = getattr(x, "item", None)
    if callable(item) and getattr(x, "ndim", 0) == 0:  # numpy/torch 0-d
        try:
            v = item()
        except Exception:
            return None
        return float(v) if isinstance(v, numbers.Real) else None
    return None


def _short(x: Any, n: int = 80) -> str:
    s = repr(x)
    return s if len(s) <= n else s[: n - 3] + "..."


def _normalise(result: Any, label: str) -> dict[str, float]:
    if isinstance(result, Mapping):
        if "score" not in result:
            raise RewardError(f"reward {label!r} returned a dict without a 'score' key "
                              f"(keys: {sorted(map(str, result))}); return a float or "
                              f"{{'score': float, ...components}}")
        out: dict[str, float] = {}
        for k, v in result.items():
            f = _to_float(v)
            if f is None:
                if k == "score":
                    raise RewardError(f"reward {label!r} returned a non-numeric 'score': {v!r}")
                continue  # non-numeric extras (e.g. a reason string) are not metrics
            if not math.isfinite(f):
                raise RewardError(f"reward {label!r} returned a non-finite {k!r}: {f}")
            out[str(k)] = f
        return out
    f = _to_float(result)
    if f is None:
        if inspect.isawaitable(result):
            close = getattr(result, "close", None)
            if callable(close):
                close()
            raise RewardError(f"reward {label!r} returned an awaitable from a plain function; "
                              f"declare it `async def` so the scorer awaits it")
        raise RewardError(f"reward {label!r} returned {type(result).__name__} {_short(result)}; "
                          f"it must return a float or a dict with a 'score' key")
    if not math.isfinite(f):
        raise RewardError(f"reward {label!r} returned a non-finite score: {f}")
    return {"score": f}


def _select(fn: Callable[..., Any], available: Mapping[str, Any], label: str) -> dict[str, Any]:
    """The keywords `fn` declares (all of them if it takes **kwargs); RewardError if one is missing."""
    var_kw, names, required = _params(fn, label)
    kwargs = dict(available) if var_kw else {k: v for k, v in available.items() if k in names}
    missing = sorted(required - kwargs.keys())
    if missing:
        raise RewardError(f"reward {label!r} requires {missing}, which is not available; rewards "
                          f"may ask for: {', '.join(AVAILABLE_KEYS)} (plus the entry's args: "
                          f"{', '.join(sorted(set(available) - set(AVAILABLE_KEYS))) or 'none'})")
    return kwargs


def _call(fn: Callable[..., Any], available: Mapping[str, Any], label: str) -> dict[str, float]:
    """A plain (synchronous, per-response) reward call."""
    return _normalise(fn(**_select(fn, available, label)), label)


# ------------------------------------------------------------------------------------- async

_loops = threading.local()


def run_coroutine(coro: Any) -> Any:
    """Run `coro` to completion on this thread's event loop (kept for the thread's lifetime, so
    an async client a reward caches between calls stays bound to a live loop)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        coro.close()
        raise RewardError("an async reward cannot be run synchronously inside a running event loop; "
                          "await it from your own loop instead")
    loop = getattr(_loops, "loop", None)
    if loop is None or loop.is_closed():
        loop = _loops.loop = asyncio.new_event_loop()
    return loop.run_until_complete(coro)


async def _await_with_timeout(coro: Any, timeout_s: float | None) -> Any:
    """Await `coro`; after `timeout_s` cancel it and raise CallTimeout. Unlike wait_for, a
    TimeoutError raised by the reward itself stays an ordinary error."""
    task = asyncio.ensure_future(coro)
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    if not done:
        task.cancel()
        raise CallTimeout(f"did not finish within {timeout_s:g} s (cancelled)")
    return task.result()


async def gather_async(fn: Callable[..., Any], items: Sequence[Mapping[str, Any]], label: str, *,
                       max_concurrency: int | None = None,
                       timeout_s: float | None = None) -> list[dict[str, float] | BaseException]:
    """An async per-response reward on every item concurrently (at most `max_concurrency` at a
    time); per item the normalised dict, or the exception (CallTimeout after `timeout_s`)."""
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def one(available: Mapping[str, Any]) -> dict[str, float]:
        if gate is None:
            return _normalise(await _await_with_timeout(fn(**_select(fn, available, label)), timeout_s), label)
        async with gate:  # the timeout counts from when the call starts, not while it queues
            return _normalise(await _await_with_timeout(fn(**_select(fn, available, label)), timeout_s), label)

    return list(await asyncio.gather(*(one(a) for a in items), return_exceptions=True))


# ------------------------------------------------------------------------------------ batched

def _batched_kwargs(items: Sequence[Mapping[str, Any]], args: Mapping[str, Any]) -> dict[str, Any]:
    """Reward keywords as lists (one entry per item), the entry's args as they are."""
    keys = [k for k in AVAILABLE_KEYS if k in items[0]] if items else list(AVAILABLE_KEYS)
    return {**{k: [item.get(k) for item in items] for k in keys}, **args}


def _as_list(result: Any) -> list[Any] | None:
    if isinstance(result, (list, tuple)):
        return list(result)
    tolist = getattr(result, "tolist", None)  # a 1-d numpy array or torch tensor of scores
    if callable(tolist) and getattr(result, "ndim", None) == 1:
        return list(tolist())
    return None


def call_batch(fn: Callable[..., Any], items: Sequence[Mapping[str, Any]], args: Mapping[str, Any],
               label: str) -> list[dict[str, float] | RewardError]:
    """A batched reward on `items` (each a `reward_kwargs` dict) in one call.

    Returns one entry per item: its normalised dict, or the RewardError for that item alone.
    Raises (RewardError, or the reward's own exception) when the call as a whole fails.
    """
    if not items:
        return []
    result = fn(**_select(fn, _batched_kwargs(items, args), label))
    if inspect.isawaitable(result):  # an `async def` batched reward
        result = run_coroutine(_wrap(result))
    scores = _as_list(result)
    if scores is None or len(scores) != len(items):
        got = f"{len(scores)} results" if scores is not None else f"{type(result).__name__} {_short(result)}"
        raise RewardError(f"batched reward {label!r} got {len(items)} responses and returned {got}; "
                          f"it must return a list with one float or dict per response")
    out: list[dict[str, float] | RewardError] = []
    for value in scores:
        try:
            out.append(_normalise(value, label))
        except RewardError as e:
            out.append(e)
    return out


async def _wrap(awaitable: Any) -> Any:
    return await awaitable


# -------------------------------------------------------------------------------- one response

def call_single(fn: Callable[..., Any], available: Mapping[str, Any], label: str) -> dict[str, float]:
    """One response through any variant: a batched reward gets a batch of one, an async reward
    runs to completion on this thread's event loop."""
    traits = traits_of(fn)
    if traits.batched:
        item = {k: v for k, v in available.items() if k in AVAILABLE_KEYS}
        args = {k: v for k, v in available.items() if k not in AVAILABLE_KEYS}
        result = call_batch(fn, [item], args, label)[0]
        if isinstance(result, RewardError):
            raise result
        return result
    if traits.is_async:
        return _normalise(run_coroutine(fn(**_select(fn, available, label))), label)
    return _call(fn, available, label)


def call_reward(fn: Callable[..., Any], /, **available: Any) -> dict[str, float]:
    """Call `fn` with only the keywords it declares (all if it takes **kwargs); return a dict.

    Works for every variant (plain, async, batched: see `mmrl.rewards.variants`). The result is
    {"score": x, ...numeric components}. Raises RewardError, naming the plugin, for a missing
    required parameter, a non-numeric result, a dict without "score", or a non-finite value.
    Exceptions raised inside the reward propagate unchanged (the reward worker reports them).
    """
    return call_single(fn, available, _fn_name(fn))
