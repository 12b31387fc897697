"""The reward calling convention.

A reward is a plain callable that takes keyword arguments and asks only for what it needs:

    def my_reward(response: str, answer, images, **_) -> float | dict: ...

Keywords on offer (see `reward_kwargs`): response (str), response_ids (list[int]), answer,
images (list of PIL images), videos, prompt (the prompt text), messages, sample (the Sample),
metadata (dict). Extra keyword arguments come from the config entry's `args`.

A reward returns a float, or a dict with a "score" key plus other numeric components (logged as
metrics). `call_reward` normalises both to dict[str, float]; `RewardSet` combines several
weighted rewards and pickles by spec so it can be shipped to Ray reward workers.
"""
from __future__ import annotations

import functools
import inspect
import math
import numbers
import os
from typing import Any, Callable, Iterable, Mapping

from mmrl.data.sample import Sample
from mmrl.registry import resolve

__all__ = ["RewardError", "AVAILABLE_KEYS", "call_reward", "reward_kwargs", "RewardSet"]

AVAILABLE_KEYS = ("response", "response_ids", "answer", "images", "videos", "prompt", "messages",
                  "sample", "metadata")


class RewardError(RuntimeError):
    """A reward plugin was called wrongly or returned something unusable; names the plugin."""


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
            raise RewardError(f"reward {label!r} is async; it returned an awaitable, not a number. "
                              f"Use a synchronous function here.")
        raise RewardError(f"reward {label!r} returned {type(result).__name__} {_short(result)}; "
                          f"it must return a float or a dict with a 'score' key")
    if not math.isfinite(f):
        raise RewardError(f"reward {label!r} returned a non-finite score: {f}")
    return {"score": f}


def _short(x: Any, n: int = 80) -> str:
    s = repr(x)
    return s if len(s) <= n else s[: n - 3] + "..."


def _call(fn: Callable[..., Any], available: Mapping[str, Any], label: str) -> dict[str, float]:
    var_kw, names, required = _params(fn, label)
    kwargs = dict(available) if var_kw else {k: v for k, v in available.items() if k in names}
    missing = sorted(required - kwargs.keys())
    if missing:
        raise RewardError(f"reward {label!r} requires {missing}, which is not available; rewards "
                          f"may ask for: {', '.join(AVAILABLE_KEYS)} (plus the entry's args: "
                          f"{', '.join(sorted(set(available) - set(AVAILABLE_KEYS))) or 'none'})")
    return _normalise(fn(**kwargs), label)


def call_reward(fn: Callable[..., Any], /, **available: Any) -> dict[str, float]:
    """Call `fn` with only the keywords it declares (all if it takes **kwargs); return a dict.

    The result is {"score": x, ...numeric components}. Raises RewardError, naming the plugin, for a
    missing required parameter, a non-numeric result, a dict without "score", or a non-finite value.
    Exceptions raised inside the reward propagate unchanged (the reward worker reports them).
    """
    return _call(fn, available, _fn_name(fn))


def reward_kwargs(sample: Sample, response: str, response_ids: Iterable[int] | None = None) -> dict[str, Any]:
    """Everything a reward may ask for, built from a Sample and one response."""
    return {
        "response": response,
        "response_ids": list(response_ids) if response_ids is not None else [],
        "answer": sample.answer,
        "images": sample.images,
        "videos": sample.videos,
        "prompt": sample.prompt_text,
        "messages": sample.messages,
        "sample": sample,
        "metadata": sample.metadata,
    }


def _portable_spec(spec: Any) -> Any:
    """Make a `path/to/file.py:fn` spec absolute, so a worker with another cwd finds the file."""
    if not isinstance(spec, str) or ":" not in spec:
        return spec
    target, _, attr = spec.rpartition(":")
    if target.endswith(".py") or "/" in target or os.sep in target:
        return f"{os.path.abspath(os.path.expanduser(target))}:{attr}"
    return spec


def _label(spec: Any) -> str:
    if isinstance(spec, str):
        return spec.rpartition(":")[2] if ":" in spec else spec
    return getattr(spec, "__name__", type(spec).__name__)


class RewardSet:
    """Several weighted rewards: score = Σ weight·score, plus components as "<name>/<key>".

    Built from config entries {"name": spec, "weight": float, "args": dict} (an optional
    "alias" renames the metric prefix, needed when one reward appears twice). `spec` is a
    registered name, `module:attr` or `path/to/file.py:attr`. Specs are validated at
    construction (fail before a run starts) but pickled as strings and resolved again lazily,
    so the set can be shipped to Ray workers even when the reward lives in a user file.
    """

    _ENTRY_KEYS = frozenset({"name", "weight", "args", "alias"})

    def __init__(self, entries: Iterable[Mapping[str, Any]]):
        self.entries: list[dict[str, Any]] = []
        seen: set[str] = set()
        for i, entry in enumerate(entries):
            if not isinstance(entry, Mapping):
                raise ValueError(f"rewards[{i}]: expected a mapping with name/weight/args, got {entry!r}")
            unknown = set(entry) - self._ENTRY_KEYS
            if unknown:
                raise ValueError(f"rewards[{i}]: unknown key(s) {sorted(unknown)}; allowed: "
                                 f"{', '.join(sorted(self._ENTRY_KEYS))}")
            if "name" not in entry:
                raise ValueError(f"rewards[{i}]: missing 'name' (a registered reward, 'module:attr' "
                                 f"or 'path/to/file.py:attr')")
            spec = _portable_spec(entry["name"])
            weight = _to_float(entry.get("weight", 1.0))
            if weight is None or not math.isfinite(weight):
                raise ValueError(f"rewards[{i}] ({entry['name']!r}): weight must be a finite number, "
                                 f"got {entry.get('weight')!r}")
            args = dict(entry.get("args") or {})
            clash = sorted(set(args) & set(AVAILABLE_KEYS))
            if clash:
                raise ValueError(f"rewards[{i}] ({entry['name']!r}): args {clash} clash with the "
                                 f"keywords every reward receives ({', '.join(AVAILABLE_KEYS)})")
            label = str(entry.get("alias") or _label(entry["name"]))
            if label in seen:
                raise ValueError(f"rewards[{i}]: reward {label!r} appears twice; give one of them "
                                 f"an 'alias' so their metrics stay apart")
            seen.add(label)
            self.entries.append({"spec": spec, "weight": weight, "args": args, "label": label})
        if not self.entries:
            raise ValueError("a RewardSet needs at least one reward entry")
        self._fns: list[Callable[..., Any]] | None = None
        self._validate()

    def _validate(self) -> None:
        """Resolve every reward and check its args against its signature, before any rollout."""
        for e, fn in zip(self.entries, self.functions()):
            var_kw, names, required = _params(fn, e["label"])
            if not var_kw:
                unknown = sorted(set(e["args"]) - names)
                if unknown:
                    raise ValueError(f"reward {e['label']!r}: args {unknown} are not parameters of "
                                     f"{_fn_name(fn)} (it takes: {', '.join(sorted(names))})")
            missing = sorted(required - set(AVAILABLE_KEYS) - set(e["args"]))
            if missing:
                raise ValueError(f"reward {e['label']!r}: {_fn_name(fn)} requires {missing}, which is "
                                 f"neither a reward keyword ({', '.join(AVAILABLE_KEYS)}) nor in its args")

    def functions(self) -> list[Callable[..., Any]]:
        """The resolved callables (resolved once per process)."""
        if self._fns is None:
            self._fns = [resolve("reward", e["spec"]) for e in self.entries]
        return self._fns

    @property
    def names(self) -> list[str]:
        return [e["label"] for e in self.entries]

    def score(self, sample: Sample, response: str, response_ids: Iterable[int] | None = None) -> dict[str, float]:
        """{"score": weighted sum, "<name>/score": ..., "<name>/<component>": ...}."""
        available = reward_kwargs(sample, response, response_ids)
        out: dict[str, float] = {"score": 0.0}
        for e, fn in zip(self.entries, self.functions()):
            result = _call(fn, {**available, **e["args"]}, e["label"])
            out["score"] += e["weight"] * result["score"]
            for k, v in result.items():
                out[f"{e['label']}/{k}"] = v
        return out

    def __call__(self, sample: Sample, response: str, response_ids: Iterable[int] | None = None) -> dict[str, float]:
        return self.score(sample, response, response_ids)

    def __getstate__(self) -> dict[str, Any]:
        # Resolved functions from user files cannot be pickled by reference; ship the specs.
        state = self.__dict__.copy()
        state["_fns"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        parts = ", ".join(f"{e['label']}×{e['weight']:g}" for e in self.entries)
        return f"RewardSet({parts})"
