"""The reward worker pool: Ray actors that score groups, with timeouts, retries and policies.

    pool = RewardPool(cfg_rewards, num_workers=2, timeout_s=30, on_error="zero")
    report = pool.score(samples, groups, decode=processor.decode)   # fills traj.reward(_components)

or group by group, while other work runs (`streaming.RewardStream` does this during rollout):

    h = pool.submit(sample, texts, response_ids)        # one Ray task per group, returns at once
    for h, res in pool.as_completed(handles):           # in finishing order (ray.wait)
        res.apply(group_of[h])

How a failure is contained
  * Inside a worker, `GroupScorer` (scorer.py) times out and isolates each reward call. A worker
    that abandoned a hanging call's thread is replaced (killed, a fresh actor started) once its
    queued groups are done.
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
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

from mmrl.data.sample import Sample
from mmrl.rewards.base import RewardSet
from mmrl.rewards.report import (ON_ERROR_POLICIES, WORKER, FailureRecord, GroupResult, RewardFailure,
                                 RewardReport, describe_exception)
from mmrl.rewards.scorer import remote_worker_class

__all__ = ["RewardPool", "RewardHandle"]

# The historical name (the pool lived in workers.py): users' logging configuration keeps working.
logger = logging.getLogger("mmrl.rewards.workers")


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
    episodes: list[dict[str, Any]] | None = None
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


def episodes_of(group: Sequence[Any]) -> list[dict[str, Any]] | None:
    """What multi-turn loops recorded per trajectory (transcript, tool state), for the rewards
    that read them; None for a single-turn group."""
    if not any(getattr(t, "transcript", None) for t in group):
        return None
    return [{"transcript": t.transcript, "tool_state": t.tool_state} for t in group]


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
        actor = remote_worker_class().options(**self.actor_options).remote(self.rewards, self.timeout_s)
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
                    answer = {"ok": False, "error": describe_exception(e), "traceback": "", "pid": "?"}
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
        h.ref = state.actor.score_group.remote(h.sample, h.texts, h.response_ids, h.episodes)
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
               response_ids: Sequence[Sequence[int]] | None = None,
               episodes: Sequence[dict[str, Any]] | None = None) -> RewardHandle:
        """Queue one group (the responses to `sample`) on the least loaded worker; returns at once."""
        if self._closed:
            raise RuntimeError("the RewardPool is closed")
        texts = [str(t) for t in texts]
        ids = [list(r) for r in response_ids] if response_ids is not None else None
        if ids is not None and len(ids) != len(texts):
            raise ValueError(f"sample {sample.key!r}: {len(texts)} texts but {len(ids)} response_ids")
        h = RewardHandle(key=str(sample.key), index=self._next_index, sample=sample, texts=texts,
                         response_ids=ids, n_calls=max(1, len(texts) * len(self.rewards.entries)),
                         episodes=list(episodes) if episodes is not None else None)
        self._next_index += 1
        self._enqueue(h)
        return h

    # -- completion
    def _deadline(self, h: RewardHandle) -> float | None:
        """When the worker running `h` (its first queued group) is declared stuck."""
        state = self._state_of(h.actor)
        if h.head_since is None or state is None or state.ready_at is None or self.timeout_s is None:
            return None  # queued behind another group, its worker is still starting, or no timeout
        return max(h.head_since, state.ready_at) + self.timeout_s * h.n_calls + self.grace_s

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
                             + (f": {describe_exception(cause)}" if cause is not None else ""), str(e))

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
                                           f"{describe_exception(e)}")
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
            seconds, started_at, finished_at = 0.0, None, None
        else:
            assert h.raw is not None
            scores = h.raw["scores"]
            failures = [FailureRecord(key=h.key, reward=f["reward"], kind=f["kind"], message=f["message"],
                                      traceback=f.get("traceback", ""), response=int(f["response"]))
                        for f in h.raw["failures"]]
            seconds = float(h.raw.get("seconds", 0.0))
            started_at, finished_at = h.raw.get("started_at"), h.raw.get("finished_at")
        for f in failures:
            self._log(f)
        if failures and policy == "stop":
            raise RewardFailure(failures[0])
        return GroupResult(key=h.key, scores=scores, failures=failures,
                           keep=not (failures and policy == "drop_group"), seconds=seconds,
                           started_at=started_at, finished_at=finished_at)

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
            if not self._pending:
                raise RuntimeError("reward handles are unfinished but nothing is pending (handle from "
                                   "another pool, or the pool was closed?)")
            self._advance(None if nearest is None else max(0.0, nearest - time.monotonic()))

    def _advance(self, timeout: float | None) -> None:
        """Wait up to `timeout` (None: forever) for one group or starting worker to answer, then
        take in everything that has answered by now."""
        import ray

        refs = list(self._pending)  # every unfinished group, so queue heads advance correctly
        starting = [s.ready_ref for s in self._slots + self._retired if s.ready_at is None and s.queue]
        refs += starting
        if not refs:
            return
        ready, rest = ray.wait(refs, num_returns=1, timeout=timeout)
        if ready:
            more = ray.wait(rest, num_returns=len(rest), timeout=0)[0] if rest else []
            for ref in list(ready) + list(more):
                if ref in starting:
                    self._check_ready(ref)
                else:
                    self._finish(ref)

    def poll(self) -> None:
        """Take in finished groups without blocking: queues shrink (so `submit` balances load on
        what is really queued), dead or overdue workers are replaced early."""
        self._kill_overdue()
        self._advance(0)

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
                               [t.response_ids for t in g], episodes_of(g)) for s, g in zip(samples, groups)]
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
