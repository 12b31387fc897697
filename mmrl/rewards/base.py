"""The reward calling convention and `RewardSet`.

A reward is a plain callable that takes keyword arguments and asks only for what it needs:

    def my_reward(response: str, answer, images, **_) -> float | dict: ...

Keywords on offer (see `reward_kwargs`): response (str), response_ids (list[int]), answer,
images (list of PIL images), videos, prompt (the prompt text), messages, sample (the Sample),
metadata (dict), transcript (list of turns) and tool_state (dict) of a multi-turn episode. Extra keyword arguments come from the config entry's `args`. It may also be
`async def`, or declared `@reward(batched=True)` to score many responses per call
(`variants.py`); `calling.py` calls every variant and normalises the results.

A reward returns a float, or a dict with a "score" key plus other numeric components (logged as
metrics). `call_reward` normalises both to dict[str, float]; `RewardSet` combines several
weighted rewards and pickles by spec so it can be shipped to Ray reward workers.
"""
from __future__ import annotations

import math
import os
from typing import Any, Callable, Iterable, Mapping

from mmrl.data.sample import Sample
from mmrl.registry import resolve
from mmrl.rewards.calling import (AVAILABLE_KEYS, RewardError, _fn_name, _params, _to_float, call_reward,
                                  call_single, yaml_boolean_problem)
from mmrl.rewards.variants import RewardTraits, reward, traits_of

__all__ = ["RewardError", "AVAILABLE_KEYS", "call_reward", "reward_kwargs", "RewardSet", "reward",
           "RewardTraits", "traits_of"]


def reward_kwargs(sample: Sample, response: str, response_ids: Iterable[int] | None = None,
                  episode: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Everything a reward may ask for, built from a Sample and one response. `episode` holds what
    a multi-turn loop recorded: `transcript` (the turns: model text, tool calls, tool results)
    and `tool_state` (the tools' final state, e.g. a GUI's success); a single-turn response is a
    transcript of one assistant turn."""
    episode = episode or {}
    return {
        "transcript": list(episode.get("transcript") or [{"role": "assistant", "content": response}]),
        "tool_state": dict(episode.get("tool_state") or {}),
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


def reward_label(spec: Any) -> str:
    """The metric prefix of a reward spec: its name, or the attribute of 'module:attr'."""
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
            label = str(entry.get("alias") or reward_label(entry["name"]))
            if label in seen:
                raise ValueError(f"rewards[{i}]: reward {label!r} appears twice; give one of them "
                                 f"an alias (alias: {label}_2) so their metrics stay apart")
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
            for name, value in e["args"].items():
                problem = yaml_boolean_problem(fn, name, value)
                if problem:
                    raise ValueError(f"reward {e['label']!r}: {problem}")
            missing = sorted(required - set(AVAILABLE_KEYS) - set(e["args"]))
            if missing:
                raise ValueError(f"reward {e['label']!r}: {_fn_name(fn)} requires {missing}, which is "
                                 f"neither a reward keyword ({', '.join(AVAILABLE_KEYS)}) nor in its args")

    def functions(self) -> list[Callable[..., Any]]:
        """The resolved callables (resolved once per process)."""
        if self._fns is None:
            self._fns = [resolve("reward", e["spec"]) for e in self.entries]
        return self._fns

    def setup(self) -> None:
        """Run each reward's `setup` hook (e.g. load its model) once in this process, with the
        entry's args it declares. Rewards without one are untouched."""
        if getattr(self, "_set_up", False):
            return
        for e, fn in zip(self.entries, self.functions()):
            hook = traits_of(fn).setup
            if hook is not None:
                var_kw, names, _ = _params(hook, e["label"])
                hook(**{k: v for k, v in e["args"].items() if var_kw or k in names})
        self._set_up = True

    @property
    def names(self) -> list[str]:
        return [e["label"] for e in self.entries]

    def score(self, sample: Sample, response: str, response_ids: Iterable[int] | None = None,
              episode: Mapping[str, Any] | None = None) -> dict[str, float]:
        """{"score": weighted sum, "<name>/score": ..., "<name>/<component>": ...}; `episode` as
        in `reward_kwargs` (a multi-turn loop's transcript and tool state)."""
        available = reward_kwargs(sample, response, response_ids, episode)
        out: dict[str, float] = {"score": 0.0}
        for e, fn in zip(self.entries, self.functions()):
            result = call_single(fn, {**available, **e["args"]}, e["label"])
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
        state["_set_up"] = False  # models are loaded again in the receiving process
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        parts = ", ".join(f"{e['label']}×{e['weight']:g}" for e in self.entries)
        return f"RewardSet({parts})"
