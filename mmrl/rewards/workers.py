"""Reward execution: a pool of Ray reward workers with per-call timeouts and failure policies.

    pool = RewardPool(cfg_rewards, num_workers=2, timeout_s=30, on_error="zero")
    report = pool.score(samples, groups, decode=processor.decode)   # fills traj.reward(_components)
    report.keep          # per group: False = no gradient for that group (policy drop_group)
    report.metrics()     # reward means + reward/errors, reward/timeouts, reward/dropped_groups, ...

or, to score groups while other rollouts are still running:

    h = pool.submit(sample, texts, response_ids)        # one Ray task per group, returns at once
    for h, res in pool.as_completed(handles):           # in finishing order (ray.wait)
        res.apply(group_of[h])                          # fills the trajectories
    report = RewardReport.from_results(results)

How a failure is contained
  * Every reward call runs in a helper thread of the worker and is abandoned after `timeout_s`
    (a hanging reward: `time.sleep`, a blocking socket read). The call counts as a timeout; the
    remaining calls of that reward on the same sample are skipped (also counted as timeouts) so
    one bad sample costs at most `timeout_s` per reward. The worker, which may still run the
    abandoned thread, is replaced (killed, a fresh actor started) once its queued groups are done.
  * An exception in one call is isolated to that (sample, response, reward); the other rewards
    of that response still count.
  * A worker process that dies (a segfault, `os._exit`) fails its queued groups; each is retried
    once on a fresh worker, so only the group that killed it twice is lost. A worker that stops
    answering altogether (a reward that blocks while holding the GIL, e.g. a C-extension loop) is
    killed by a driver-side deadline (`timeout_s` per call of the group + `grace_s`, counted
    from when the group reaches the front of its worker's queue), and a replacement worker that
    does not start within `start_timeout_s` is replaced again.
  * `on_error` decides what a failure means for training: "zero" (that reward scores 0 for that
    response), "drop_group" (the group's `keep` is False: the controller gives it no gradient),
    "stop" (raise `RewardFailure` naming the reward, the sample key and the traceback).
  * Each failure is logged once (logger "mmrl.rewards.workers"): the first `log_first` at WARNING,
    later ones at DEBUG; all are counted in the report.
"""
from __future__ import annotations

import collections
import logging
import os
import queue
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

from mmrl.data.sample import Sample
from mmrl.rewards.base import RewardSet, _call, reward_kwargs

__all__ = ["RewardPool", "RewardReport", "GroupResult", "FailureRecord", "RewardFailure", "RewardHandle",
           "GroupScorer", "ON_ERROR_POLICIES"]

logger = logging.getLogger(__name__)

ON_ERROR_POLICIES = ("zero", "drop_group", "stop")
WORKER = "<worker>"  # the reward name of a failure that lost the whole group (the worker died)


# ---------------------------------------------------------------------------------------- records

@dataclass
class FailureRecord:
    """One failed reward call (or a whole group, when its worker was lost)."""

    key: str  # sample key
    reward: str  # reward label (its metric prefix), or "<worker>"
    kind: str  # "error" | "timeout" | "worker_lost"
    message: str
    traceback: str = ""
    response: int = -1  # index of the response in its group; -1: every response

    def describe(self) -> str:
        where = f"response {self.response}" if self.response >= 0 else "all responses"
        text = f"reward {self.reward!r} {self.kind} on sample {self.key!r} ({where}): {self.message}"
        return text + ("\n" + self.traceback.rstrip() if self.traceback else "")


class RewardFailure(RuntimeError):
    """A reward failed under on_error="stop"; names the reward, the sample key, the traceback."""

    def __init__(self, record: FailureRecord):
        super().__init__(record.describe() + "\n(set the reward pool's on_error to 'zero' or "
                                              "'drop_group' to continue past failing samples)")
        self.record = record


@dataclass
class GroupResult:
    """The scores of one group: per response {"score": weighted sum, "<name>/<component>": ...}."""

    key: str
    scores: list[dict[str, float]]
    failures: list[FailureRecord] = field(default_factory=list)
    keep: bool = True
    seconds: float = 0.0  # time the worker spent on the group

    def apply(self, group: Sequence[Any]) -> None:
        """Fill `reward` and `reward_components` of the group's trajectories."""
        if len(group) != len(self.scores):
            raise ValueError(f"sample {self.key!r}: {len(self.scores)} scores for a group of {len(group)}")
        for traj, scores in zip(group, self.scores):
            traj.reward = float(scores["score"])
            traj.reward_components = dict(scores)


@dataclass
class RewardReport:
    """What one batch of groups cost: counts, failures, and per-group keep mask."""

    keep: list[bool]
    errors: int = 0  # failed calls (exceptions, bad return values, lost workers)
    timeouts: int = 0  # calls abandoned or skipped after timeout_s
    dropped_groups: int = 0  # groups with keep=False
    errors_by_reward: dict[str, int] = field(default_factory=dict)
    timeouts_by_reward: dict[str, int] = field(default_factory=dict)
    failures: list[FailureRecord] = field(default_factory=list)
    means: dict[str, float] = field(default_factory=dict)  # "reward/mean", "reward/<name>/<comp>"
    seconds: float = 0.0  # wall time of score()

    @classmethod
    def from_results(cls, results: Sequence[GroupResult], seconds: float = 0.0) -> "RewardReport":
        report = cls(keep=[r.keep for r in results], seconds=seconds)
        totals: dict[str, list[float]] = {}
        for r in results:
            report.dropped_groups += not r.keep
            for f in r.failures:
                report.failures.append(f)
                if f.kind == "timeout":
                    report.timeouts += 1
                    report.timeouts_by_reward[f.reward] = report.timeouts_by_reward.get(f.reward, 0) + 1
                else:
                    report.errors += 1
                    report.errors_by_reward[f.reward] = report.errors_by_reward.get(f.reward, 0) + 1
            for s in r.scores:
                for k, v in s.items():
                    totals.setdefault(k, []).append(float(v))
        report.means = {("reward/mean" if k == "score" else f"reward/{k}"): sum(v) / len(v)
                        for k, v in totals.items()}
        return report

    def metrics(self) -> dict[str, float]:
        """Means of every component plus failure counts, ready for the metrics sinks."""
        out = dict(self.means)
        out["reward/errors"] = float(self.errors)
        out["reward/timeouts"] = float(self.timeouts)
        out["reward/dropped_groups"] = float(self.dropped_groups)
        out["reward/seconds"] = float(self.seconds)
        for name, n in self.errors_by_reward.items():
            out[f"reward/errors/{name}"] = float(n)
        for name, n in self.timeouts_by_reward.items():
            out[f"reward/timeouts/{name}"] = float(n)
        return out


# ------------------------------------------------------------------------- scoring (any process)

def _safe_str(e: BaseException) -> str:
    try:
        return f"{type(e).__name__}: {e}"
    except Exception:  # an exception whose __str__ raises
        return type(e).__name__


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
                out = ("error", _safe_str(e), traceback.format_exc())
            self._outbox.put(out)

    def call(self, fn: Callable[..., Any], args: tuple, timeout: float) -> tuple[str, Any, str] | None:
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

    Used inside the reward workers and in-process by `mmrl rewards check`. `timeout_s=None` runs
    the calls inline (no thread, no timeout). After a timeout `tainted` is True: an abandoned
    thread may still be running in this process.
    """

    def __init__(self, rewards: RewardSet, timeout_s: float | None = 30.0):
        self.rewards = rewards
        self.timeout_s = timeout_s if timeout_s and timeout_s > 0 else None
        self.tainted = False
        self._thread: _CallThread | None = None

    def _run(self, fn: Callable[..., Any], args: tuple) -> tuple[str, Any, str]:
        if self.timeout_s is None:
            try:
                return "ok", fn(*args), ""
            except Exception as e:
                return "error", _safe_str(e), traceback.format_exc()
        if self._thread is None:
            self._thread = _CallThread()
        out = self._thread.call(fn, args, self.timeout_s)
        if out is None:  # abandon the thread (it may never return); the next call gets a new one
            stack, self._thread, self.tainted = self._thread.stack(), None, True
            return "timeout", f"did not return within {self.timeout_s:g} s (abandoned)", stack
        return out

    def score_response(self, sample: Sample, response: str, response_ids: Iterable[int] | None = None,
                       skip: Mapping[str, str] | None = None) -> tuple[dict[str, float], list[dict[str, str]]]:
        """({"score": ..., "<name>/<comp>": ...}, [failure dicts]); a failed reward scores 0.

        `skip` maps reward labels to a reason: those rewards are not called (counted as timeouts).
        """
        available = reward_kwargs(sample, response, response_ids)
        out: dict[str, float] = {"score": 0.0}
        failures: list[dict[str, str]] = []
        for e, fn in zip(self.rewards.entries, self.rewards.functions()):
            label = e["label"]
            if skip and label in skip:
                failures.append({"reward": label, "kind": "timeout", "message": skip[label], "traceback": ""})
                out[f"{label}/score"] = 0.0
                continue
            status, value, tb = self._run(_call, (fn, {**available, **e["args"]}, label))
            if status != "ok":
                failures.append({"reward": label, "kind": status, "message": value, "traceback": tb})
                out[f"{label}/score"] = 0.0
                continue
            out["score"] += e["weight"] * value["score"]
            for k, v in value.items():
                out[f"{label}/{k}"] = v
        return out, failures

    def score_group(self, sample: Sample, texts: Sequence[str],
                    response_ids: Sequence[Iterable[int] | None] | None = None) -> dict[str, Any]:
        """Score every response of one sample; returns plain data (scores, failures, tainted)."""
        t0 = time.perf_counter()
        ids = list(response_ids) if response_ids is not None else [None] * len(texts)
        scores: list[dict[str, float]] = []
        failures: list[dict[str, Any]] = []
        skip: dict[str, str] = {}
        for j, (text, rid) in enumerate(zip(texts, ids)):
            s, fails = self.score_response(sample, text, rid, skip)
            scores.append(s)
            for f in fails:
                f["response"] = j
                failures.append(f)
                if f["kind"] == "timeout" and f["reward"] not in skip:
                    skip[f["reward"]] = (f"skipped: {f['reward']} timed out on response {j} of this sample")
        return {"scores": scores, "failures": failures, "tainted": self.tainted,
                "seconds": time.perf_counter() - t0, "pid": os.getpid()}


class _RewardWorker:
    """The Ray actor body: one RewardSet (shipped by spec, resolved here) and a GroupScorer."""

    def __init__(self, rewards: RewardSet, timeout_s: float | None):
        self.scorer = GroupScorer(rewards, timeout_s)

    def ready(self) -> dict[str, Any]:
        """Resolve (import) every reward here; report an import failure instead of raising."""
        try:
            self.scorer.rewards.functions()
        except Exception as e:
            return {"ok": False, "error": _safe_str(e), "traceback": traceback.format_exc(), "pid": os.getpid()}
        return {"ok": True, "names": self.scorer.rewards.names, "pid": os.getpid(), "cwd": os.getcwd()}

    def score_group(self, sample: Sample, texts: Sequence[str],
                    response_ids: Sequence[Iterable[int] | None] | None) -> dict[str, Any]:
        return self.scorer.score_group(sample, texts, response_ids)


_REMOTE_WORKER: Any = None


def _remote_worker_class() -> Any:
    global _REMOTE_WORKER
    if _REMOTE_WORKER is None:
        import ray

        _REMOTE_WORKER = ray.remote(_RewardWorker)
    return _REMOTE_WORKER


# ----------------------------------------------------------------------------------- the pool

@dataclass(eq=False)
class RewardHandle:
    """A submitted group. Opaque to callers except `key`, `index` (submission order), `done`."""

    key: str
    index: int
    sample: Sample
    texts: list[str]
    response_ids: list[list[int]] | None
    n_calls: int
    ref: Any = None
    actor: Any = None
    head_since: float | None = None  # when it became the first queued group of its actor
    retries: int = 0  # re-runs after its worker died while running it
    requeued: int = 0  # re-runs after a worker died while it waited behind another group
    killed_for_timeout: bool = False
    raw: dict[str, Any] | None = None  # the worker's answer, once finished
    lost: FailureRecord | None = None  # the whole group failed (worker lost / deadline)

    @property
    def done(self) -> bool:
        return self.raw is not None or self.lost is not None


@dataclass(eq=False)
class _ActorState:
    actor: Any
    queue: collections.deque = field(default_factory=collections.deque)  # RewardHandles, in order
    retired: bool = False
    ready_ref: Any = None  # the actor's ready() call (imports the rewards)
    ready_at: float | None = None  # when the driver saw it answer
    created: float = field(default_factory=time.monotonic)


class RewardPool:
    """`num_workers` Ray actors (num_cpus=0), each holding the RewardSet built from `entries`.

    `entries`: a RewardSet, or config entries [{"name", "weight", "args", "alias"}] (built and
    validated here, in the driver, so file paths are made absolute before they are shipped).
    Raises PluginError if a reward does not import inside the workers.
    """

    def __init__(self, entries: RewardSet | Iterable[Mapping[str, Any]], *, num_workers: int = 1,
                 timeout_s: float | None = 30.0, on_error: str = "zero", grace_s: float = 30.0,
                 start_timeout_s: float = 120.0, log_first: int = 5,
                 actor_options: Mapping[str, Any] | None = None):
        import ray

        if on_error not in ON_ERROR_POLICIES:
            raise ValueError(f"on_error must be one of {', '.join(ON_ERROR_POLICIES)}, got {on_error!r}")
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if not ray.is_initialized():
            raise RuntimeError("RewardPool needs Ray: call ray.init(...) first")
        self.rewards = entries if isinstance(entries, RewardSet) else RewardSet(entries)
        self.timeout_s = timeout_s if timeout_s and timeout_s > 0 else None
        self.on_error = on_error
        self.grace_s = grace_s
        self.start_timeout_s = start_timeout_s
        self.log_first = log_first
        self.actor_options = {"num_cpus": 0, "max_restarts": 0, **(actor_options or {})}
        self.replaced = 0  # workers replaced (after a timeout, a crash, or a missed deadline)
        self._logged = 0
        self._next_index = 0
        self._slots: list[_ActorState] = []
        self._retired: list[_ActorState] = []
        self._pending: dict[Any, RewardHandle] = {}  # ref -> handle, every unfinished group
        self._closed = False
        self._slots = [self._new_state() for _ in range(num_workers)]
        try:
            answers = ray.get([s.ready_ref for s in self._slots], timeout=start_timeout_s)
        except Exception:
            self.close()
            raise
        for s in self._slots:
            s.ready_at = time.monotonic()
        bad = next((a for a in answers if not a["ok"]), None)
        if bad is not None:
            self.close()
            from mmrl.registry import PluginError

            raise PluginError(f"the reward plugins do not load inside the reward workers (pid {bad['pid']}): "
                              f"{bad['error']}. The worker's traceback:\n{bad['traceback']}")

    # -- actors
    def _new_state(self) -> _ActorState:
        actor = _remote_worker_class().options(**self.actor_options).remote(self.rewards, self.timeout_s)
        return _ActorState(actor, ready_ref=actor.ready.remote())

    def _check_ready(self, ref: Any) -> None:
        """A (replacement) worker answered ready(): its queued groups' deadlines start now."""
        import ray

        for state in self._slots + self._retired:
            if state.ready_ref == ref and state.ready_at is None:
                state.ready_at = time.monotonic()
                try:
                    answer = ray.get(ref)
                except Exception as e:  # it died starting; its queued groups report that
                    answer = {"ok": False, "error": _safe_str(e), "traceback": "", "pid": "?"}
                if not answer["ok"]:
                    logger.warning("a replacement reward worker cannot load the rewards: %s\n%s",
                                   answer["error"], answer["traceback"])

    def _state_of(self, actor: Any) -> _ActorState | None:
        for s in self._slots + self._retired:
            if s.actor is actor:
                return s
        return None

    def _retire(self, state: _ActorState, kill_now: bool = False) -> None:
        """Start a fresh actor in `state`'s slot; kill the old one now or once its queue is empty."""
        import ray

        if state.retired:
            return
        state.retired = True
        self.replaced += 1
        i = next((i for i, s in enumerate(self._slots) if s is state), None)
        if i is not None and not self._closed:
            self._slots[i] = self._new_state()
        self._retired.append(state)
        if kill_now or not state.queue:
            ray.kill(state.actor, no_restart=True)
            if not state.queue:
                self._retired.remove(state)

    def _enqueue(self, h: RewardHandle) -> None:
        state = min(self._slots, key=lambda s: len(s.queue))  # least loaded worker
        h.actor = state.actor
        h.ref = state.actor.score_group.remote(h.sample, h.texts, h.response_ids)
        h.head_since = time.monotonic() if not state.queue else None
        state.queue.append(h)
        self._pending[h.ref] = h

    def _dequeue(self, h: RewardHandle) -> None:
        import ray

        self._pending.pop(h.ref, None)
        state = self._state_of(h.actor)
        if state is None:
            return
        try:
            state.queue.remove(h)
        except ValueError:
            pass
        if state.queue and state.queue[0].head_since is None:
            state.queue[0].head_since = time.monotonic()
        if state.retired and not state.queue and state in self._retired:
            ray.kill(state.actor, no_restart=True)
            self._retired.remove(state)

    # -- submission
    def submit(self, sample: Sample, texts: Sequence[str],
               response_ids: Sequence[Sequence[int]] | None = None) -> RewardHandle:
        """Queue one group (the responses to `sample`) on the least loaded worker; returns at once."""
        if self._closed:
            raise RuntimeError("the RewardPool is closed")
        texts = [str(t) for t in texts]
        ids = [list(r) for r in response_ids] if response_ids is not None else None
        if ids is not None and len(ids) != len(texts):
            raise ValueError(f"sample {sample.key!r}: {len(texts)} texts but {len(ids)} response_ids")
        h = RewardHandle(key=str(sample.key), index=self._next_index, sample=sample, texts=texts,
                         response_ids=ids, n_calls=max(1, len(texts) * len(self.rewards.entries)))
        self._next_index += 1
        self._enqueue(h)
        return h

    # -- completion
    def _deadline(self, h: RewardHandle) -> float | None:
        """When the worker running `h` (its first queued group) is declared stuck."""
        state = self._state_of(h.actor)
        if h.head_since is None or state is None or state.ready_at is None:
            return None  # queued behind another group, or its worker is still starting
        per_call = self.timeout_s if self.timeout_s is not None else float("inf")
        return max(h.head_since, state.ready_at) + per_call * h.n_calls + self.grace_s

    def _finish(self, ref: Any) -> None:
        """A finished ref: record its answer, or handle the death of its worker."""
        import ray
        from ray.exceptions import RayError, RayTaskError

        h = self._pending.get(ref)
        if h is None:
            return
        try:
            raw = ray.get(ref)
        except RayTaskError as e:  # the worker failed outside a reward call (e.g. unpickling the sample)
            self._dequeue(h)
            h.lost = self._task_error(h, e)
            return
        except RayError:  # RayActorError & co: the worker process died or was killed
            self._worker_died(h)
            return
        self._dequeue(h)
        h.raw = raw
        if raw.get("tainted"):
            state = self._state_of(h.actor)
            if state is not None and not state.retired:
                self._retire(state)  # leaked threads: replace once its queued groups are done

    @staticmethod
    def _task_error(h: RewardHandle, e: BaseException) -> FailureRecord:
        cause = getattr(e, "cause", None)
        return FailureRecord(h.key, WORKER, "error", "the reward worker failed outside a reward call"
                             + (f": {_safe_str(cause)}" if cause is not None else ""), str(e))

    def _worker_died(self, h: RewardHandle) -> None:
        """The worker of `h` died. Walk its queue in order: groups that finished before keep their
        answer; the first failed one was running (the culprit: retried once, then lost, or lost at
        once if the deadline killed it); the ones queued behind it are rescored elsewhere."""
        import ray
        from ray.exceptions import RayError, RayTaskError

        state = self._state_of(h.actor)
        queued = list(state.queue) if state is not None and h in state.queue else [h]
        if state is not None:
            if not state.retired:
                self._retire(state, kill_now=True)
            else:
                ray.kill(state.actor, no_restart=True)
            state.queue.clear()
            if state in self._retired:
                self._retired.remove(state)
        culprit: RewardHandle | None = None
        again: list[RewardHandle] = []
        for x in queued:
            self._pending.pop(x.ref, None)
            if culprit is not None:
                x.requeued += 1
                if x.requeued > 3:
                    x.lost = FailureRecord(x.key, WORKER, "worker_lost",
                                           "reward workers died 4 times while this sample was queued")
                else:
                    again.append(x)
                continue
            try:
                x.raw = ray.get(x.ref, timeout=10)
                continue
            except RayTaskError as e:
                x.lost = self._task_error(x, e)
                continue
            except RayError as e:  # (GetTimeoutError included)
                culprit = x
                if x.killed_for_timeout:
                    budget = (self.timeout_s or 0) * x.n_calls + self.grace_s
                    x.lost = FailureRecord(
                        x.key, WORKER, "timeout",
                        f"the reward worker did not answer within {budget:g} s (timeout_s per call + "
                        f"grace_s) and was killed; a reward probably blocks while holding the GIL "
                        f"(a C-extension loop, a catastrophic regular expression)")
                elif x.retries < 1:
                    x.retries += 1
                else:
                    x.lost = FailureRecord(x.key, WORKER, "worker_lost",
                                           f"the reward worker died twice while scoring this sample: "
                                           f"{_safe_str(e)}")
        for x in again:  # the groups behind the culprit first, so a second crash does not hit them
            self._enqueue(x)
        if culprit is not None and culprit.lost is None and culprit.raw is None:
            self._enqueue(culprit)

    def _kill_overdue(self) -> float | None:
        """Kill the workers whose head group is past its deadline; return the next deadline."""
        now = time.monotonic()
        nearest: float | None = None
        for state in list(self._slots + self._retired):  # workers that do not finish starting
            if state.ready_at is None and state.queue and not state.retired:
                d = state.created + self.start_timeout_s
                if d <= now:
                    logger.warning("a reward worker did not start within %g s; replacing it", self.start_timeout_s)
                    self._retire(state, kill_now=True)
                else:
                    nearest = d if nearest is None else min(nearest, d)
        for h in list(self._pending.values()):
            d = self._deadline(h)
            if d is None or h.killed_for_timeout:
                continue
            if d <= now:
                h.killed_for_timeout = True
                state = self._state_of(h.actor)
                if state is not None and not state.retired:
                    self._retire(state, kill_now=True)
                elif state is not None:  # a retiring (tainted) worker is the one stuck
                    import ray

                    ray.kill(state.actor, no_restart=True)
            else:
                nearest = d if nearest is None else min(nearest, d)
        return nearest

    def _result(self, h: RewardHandle, policy: str) -> GroupResult:
        if h.lost is not None:
            n = len(h.texts)
            scores = [{"score": 0.0, **{f"{e['label']}/score": 0.0 for e in self.rewards.entries}}
                      for _ in range(n)]
            failures = [h.lost]
            seconds = 0.0
        else:
            assert h.raw is not None
            scores = h.raw["scores"]
            failures = [FailureRecord(key=h.key, reward=f["reward"], kind=f["kind"], message=f["message"],
                                      traceback=f.get("traceback", ""), response=int(f["response"]))
                        for f in h.raw["failures"]]
            seconds = float(h.raw.get("seconds", 0.0))
        for f in failures:
            self._log(f)
        if failures and policy == "stop":
            raise RewardFailure(failures[0])
        return GroupResult(key=h.key, scores=scores, failures=failures,
                           keep=not (failures and policy == "drop_group"), seconds=seconds)

    def _log(self, f: FailureRecord) -> None:
        level = logging.WARNING if self._logged < self.log_first else logging.DEBUG
        self._logged += 1
        suffix = ("\n(further reward failures are logged at DEBUG; the counts are in the reward metrics)"
                  if self._logged == self.log_first else "")
        logger.log(level, "%s%s", f.describe(), suffix)

    def as_completed(self, handles: Iterable[RewardHandle], *,
                     on_error: str | None = None) -> Iterator[tuple[RewardHandle, GroupResult]]:
        """Yield (handle, GroupResult) for each handle as its group finishes (ray.wait).

        `on_error` overrides the pool's policy for these groups; under "stop" the first failing
        group raises RewardFailure (the other groups keep running in the workers).
        """
        import ray

        policy = on_error or self.on_error
        if policy not in ON_ERROR_POLICIES:
            raise ValueError(f"on_error must be one of {', '.join(ON_ERROR_POLICIES)}, got {policy!r}")
        waiting = list(handles)
        while waiting:
            for h in [h for h in waiting if h.done]:
                waiting.remove(h)
                yield h, self._result(h, policy)
            if not waiting:
                return
            nearest = self._kill_overdue()
            refs = list(self._pending)  # every unfinished group, so queue heads advance correctly
            if not refs:
                raise RuntimeError("reward handles are unfinished but nothing is pending (handle from "
                                   "another pool, or the pool was closed?)")
            starting = [s.ready_ref for s in self._slots + self._retired if s.ready_at is None and s.queue]
            refs += starting
            timeout = None if nearest is None else max(0.0, nearest - time.monotonic())
            ready, _ = ray.wait(refs, num_returns=1, timeout=timeout)
            if ready:
                rest = [r for r in refs if r not in ready]
                more = ray.wait(rest, num_returns=len(rest), timeout=0)[0] if rest else []
                for ref in list(ready) + list(more):
                    if ref in starting:
                        self._check_ready(ref)
                    else:
                        self._finish(ref)

    def collect(self, handles: Sequence[RewardHandle], *, on_error: str | None = None) -> list[GroupResult]:
        """Wait for every handle; results in the order of `handles`."""
        out: dict[int, GroupResult] = {}
        for h, res in self.as_completed(handles, on_error=on_error):
            out[id(h)] = res
        return [out[id(h)] for h in handles]

    def score(self, samples: Sequence[Sample], groups: Sequence[Sequence[Any]],
              decode: Callable[[list[int]], str] | None = None, *,
              on_error: str | None = None) -> RewardReport:
        """Score every group (one task each), fill the trajectories, return the report.

        `decode` turns response ids into the text the rewards see (default: each trajectory's
        `text`)."""
        if len(samples) != len(groups):
            raise ValueError(f"{len(samples)} samples but {len(groups)} groups")
        t0 = time.perf_counter()
        handles = [self.submit(s, [decode(t.response_ids) if decode else t.text for t in g],
                               [t.response_ids for t in g]) for s, g in zip(samples, groups)]
        position = {id(h): i for i, h in enumerate(handles)}
        results: list[GroupResult | None] = [None] * len(handles)
        for h, res in self.as_completed(handles, on_error=on_error):
            i = position[id(h)]
            res.apply(groups[i])
            results[i] = res
        return RewardReport.from_results([r for r in results if r is not None], time.perf_counter() - t0)

    # -- lifetime
    @property
    def num_workers(self) -> int:
        return len(self._slots)

    def close(self) -> None:
        """Kill every worker (pending groups are abandoned)."""
        import ray

        if self._closed:
            return
        self._closed = True
        for s in self._slots + self._retired:
            try:
                ray.kill(s.actor, no_restart=True)
            except Exception:  # already dead
                pass
        self._retired.clear()
        self._pending.clear()

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"RewardPool({self.rewards!r}, workers={self.num_workers}, timeout_s={self.timeout_s}, "
                f"on_error={self.on_error!r})")
