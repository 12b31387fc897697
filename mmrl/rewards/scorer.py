"""Scoring groups of responses in one process, each reward call isolated and timed out.

`GroupScorer` is what runs inside every reward worker (`RewardWorker`, the Ray actor body that
`pool.py` starts) and in-process in `mmrl rewards check`. Per reward it picks the variant's
path (`variants.py`):

  plain     one call per response, each in a helper thread abandoned after `timeout_s`; after a
            timeout the reward's remaining calls on that sample are skipped (counted as timeouts)
  batched   one call for the whole group, abandoned after `timeout_s` x the group size
  async     every response's call concurrently on the helper thread's event loop, each cancelled
            after `timeout_s` (a cancelled call does not leak a thread)

A failed call scores 0 for that reward and response and is reported; the other rewards count.
"""
from __future__ import annotations

import math
import os
import queue
import sys
import threading
import time
import traceback
from typing import Any, Callable, Iterable, Mapping, Sequence

from mmrl.data.sample import Sample
from mmrl.rewards.base import RewardSet, reward_kwargs
from mmrl.rewards.calling import CallTimeout, _call, call_batch, gather_async, run_coroutine
from mmrl.rewards.report import describe_exception
from mmrl.rewards.variants import traits_of

__all__ = ["GroupScorer", "RewardWorker", "remote_worker_class"]

# (status, value, traceback): ("ok", {"score": ...}, "") or ("error" | "timeout", message, traceback)
Outcome = tuple[str, Any, str]


class _CallThread:
    """A daemon thread that runs reward calls one at a time, so the caller can stop waiting."""

    def __init__(self) -> None:
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name="mmrl-reward-call", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            fn, args = self._inbox.get()
            try:
                out = ("ok", fn(*args), "")
            except BaseException as e:  # noqa: BLE001 - SystemExit from a reward must not end the thread silently
                out = ("error", describe_exception(e), traceback.format_exc())
            self._outbox.put(out)

    def call(self, fn: Callable[..., Any], args: tuple, timeout: float) -> Outcome | None:
        """(status, value, traceback), or None when it did not return within `timeout`."""
        self._inbox.put((fn, args))
        try:
            return self._outbox.get(timeout=timeout)
        except queue.Empty:
            return None

    def stack(self) -> str:
        """Where the (hanging) call is now: the thread's current stack."""
        frame = sys._current_frames().get(self.thread.ident or -1)
        return "".join(traceback.format_stack(frame)) if frame is not None else ""


class GroupScorer:
    """Scores groups of responses with a RewardSet, each call isolated and (optionally) timed out.

    `timeout_s=None` runs the calls inline (no thread, no timeout). After a timeout `tainted` is
    True: an abandoned thread may still be running in this process.
    """

    def __init__(self, rewards: RewardSet, timeout_s: float | None = 30.0):
        self.rewards = rewards
        self.timeout_s = timeout_s if timeout_s and timeout_s > 0 else None
        self.tainted = False
        self._thread: _CallThread | None = None

    def setup(self) -> None:
        """Import the rewards and run their setup hooks (model loading), outside any timeout."""
        self.rewards.functions()
        self.rewards.setup()

    def _run(self, fn: Callable[..., Any], args: tuple, timeout: float | None) -> Outcome:
        if timeout is None:
            try:
                return "ok", fn(*args), ""
            except Exception as e:
                return "error", describe_exception(e), traceback.format_exc()
        if self._thread is None:
            self._thread = _CallThread()
        out = self._thread.call(fn, args, timeout)
        if out is None:  # abandon the thread (it may never return); the next call gets a new one
            stack, self._thread, self.tainted = self._thread.stack(), None, True
            return "timeout", f"did not return within {timeout:g} s (abandoned)", stack
        return out

    # -- one reward on every response of a group
    def _plain(self, fn: Callable[..., Any], items: list[dict[str, Any]], args: Mapping[str, Any],
               label: str) -> list[Outcome]:
        out: list[Outcome] = []
        for j, item in enumerate(items):
            result = self._run(_call, (fn, {**item, **args}, label), self.timeout_s)
            out.append(result)
            if result[0] == "timeout":  # one bad sample costs at most one timeout per reward
                skipped = ("timeout", f"skipped: {label} timed out on response {j} of this sample", "")
                return out + [skipped] * (len(items) - j - 1)
        return out

    def _batched(self, fn: Callable[..., Any], items: list[dict[str, Any]], args: Mapping[str, Any],
                 label: str) -> list[Outcome]:
        timeout = None if self.timeout_s is None else self.timeout_s * len(items)
        status, value, tb = self._run(call_batch, (fn, items, dict(args), label), timeout)
        if status != "ok":
            return [(status, value, tb)] * len(items)
        return [("ok", v, "") if isinstance(v, dict) else ("error", describe_exception(v), "") for v in value]

    def _async(self, fn: Callable[..., Any], items: list[dict[str, Any]], args: Mapping[str, Any],
               label: str, max_concurrency: int | None) -> list[Outcome]:
        calls = [{**item, **args} for item in items]
        waves = math.ceil(len(items) / max_concurrency) if max_concurrency else 1
        # Each call is cancelled after timeout_s inside the loop; the thread deadline only fires
        # when the loop itself is blocked (a synchronous sleep inside `async def`).
        timeout = None if self.timeout_s is None else self.timeout_s * waves + 1.0

        def run() -> list[Any]:
            return run_coroutine(gather_async(fn, calls, label, max_concurrency=max_concurrency,
                                              timeout_s=self.timeout_s))

        status, value, tb = self._run(run, (), timeout)
        if status != "ok":
            return [(status, value, tb)] * len(items)
        out: list[Outcome] = []
        for v in value:
            if isinstance(v, dict):
                out.append(("ok", v, ""))
            elif isinstance(v, CallTimeout):
                out.append(("timeout", str(v), ""))
            else:
                out.append(("error", describe_exception(v), "".join(traceback.format_exception(v))))
        return out

    def _score_reward(self, fn: Callable[..., Any], items: list[dict[str, Any]], args: Mapping[str, Any],
                      label: str) -> list[Outcome]:
        traits = traits_of(fn)
        if traits.batched:
            return self._batched(fn, items, args, label)
        if traits.is_async:
            return self._async(fn, items, args, label, traits.max_concurrency)
        return self._plain(fn, items, args, label)

    # -- public
    def score_group(self, sample: Sample, texts: Sequence[str],
                    response_ids: Sequence[Iterable[int] | None] | None = None,
                    episodes: Sequence[Mapping[str, Any] | None] | None = None) -> dict[str, Any]:
        """Score every response of one sample; returns plain data (scores, failures, tainted, timings).

        scores[j] = {"score": Σ weight·score, "<name>/<component>": ...}; a failed reward scores 0.
        """
        self.setup()
        started_at, t0 = time.time(), time.perf_counter()
        ids = list(response_ids) if response_ids is not None else [None] * len(texts)
        eps = list(episodes) if episodes is not None else [None] * len(texts)
        items = [reward_kwargs(sample, text, rid, ep) for text, rid, ep in zip(texts, ids, eps)]
        entries = self.rewards.entries
        outcomes = [self._score_reward(fn, items, e["args"], e["label"])
                    for e, fn in zip(entries, self.rewards.functions())]
        scores: list[dict[str, float]] = []
        failures: list[dict[str, Any]] = []
        for j in range(len(items)):
            out: dict[str, float] = {"score": 0.0}
            for e, per_response in zip(entries, outcomes):
                label = e["label"]
                status, value, tb = per_response[j]
                if status != "ok":
                    failures.append({"reward": label, "kind": status, "message": value, "traceback": tb,
                                     "response": j})
                    out[f"{label}/score"] = 0.0
                    continue
                out["score"] += e["weight"] * value["score"]
                for k, v in value.items():
                    out[f"{label}/{k}"] = v
            scores.append(out)
        return {"scores": scores, "failures": failures, "tainted": self.tainted,
                "seconds": time.perf_counter() - t0, "started_at": started_at, "finished_at": time.time(),
                "pid": os.getpid()}

    def score_response(self, sample: Sample, response: str,
                       response_ids: Iterable[int] | None = None) -> tuple[dict[str, float], list[dict[str, Any]]]:
        """({"score": ..., "<name>/<comp>": ...}, [failure dicts]) for one response."""
        result = self.score_group(sample, [response], [response_ids])
        return result["scores"][0], result["failures"]


# ------------------------------------------------------------------- the reward worker actor

class RewardWorker:
    """The Ray actor body: one RewardSet (shipped by spec, resolved here) and a GroupScorer."""

    def __init__(self, rewards: RewardSet, timeout_s: float | None):
        self.scorer = GroupScorer(rewards, timeout_s)

    def ready(self) -> dict[str, Any]:
        """Import every reward and run its setup hook (model loading) here, before any timed
        call; report a failure instead of raising."""
        try:
            self.scorer.setup()
        except Exception as e:
            return {"ok": False, "error": describe_exception(e), "traceback": traceback.format_exc(), "pid": os.getpid()}
        return {"ok": True, "names": self.scorer.rewards.names, "pid": os.getpid(), "cwd": os.getcwd()}

    def score_group(self, sample: Sample, texts: Sequence[str],
                    response_ids: Sequence[Iterable[int] | None] | None,
                    episodes: Sequence[Mapping[str, Any] | None] | None = None) -> dict[str, Any]:
        return self.scorer.score_group(sample, texts, response_ids, episodes)


_REMOTE_WORKER: Any = None


def remote_worker_class() -> Any:
    """`RewardWorker` as a Ray actor class, made once per process (Ray is imported lazily)."""
    global _REMOTE_WORKER
    if _REMOTE_WORKER is None:
        import ray

        _REMOTE_WORKER = ray.remote(RewardWorker)
    return _REMOTE_WORKER
