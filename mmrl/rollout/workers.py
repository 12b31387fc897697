"""Rollout workers: Ray actors (asyncio) that turn samples into groups of trajectories.

A worker owns a processor and a router over the engines. `rollout_group(sample, slot, sampling)`
processes the sample once, then runs `sampling.n` agent loops on it at once (one trajectory
each) and returns the group. The driver only hands out samples and collects groups:
`RolloutWorkers.submit` spreads groups over the workers (fewest groups outstanding) and returns
a Ray reference per group, which the controller waits on (controller/rollout.py). The trainer
side of the processed prompt (pixel tensors included) stays in this worker's object store: the
outcome carries a `PromptRef`, which the trainer ranks resolve themselves.

A sample the processor refuses costs that sample only: the group comes back as a `BadSample`
(reason `prompt_rejected` or `processor_error`), which the driver quarantines and replaces.
An agent loop that raises is a bug in the loop, not in the data: the group fails with the
loop's name, the sample key and the original error.

Dead actors are replaced, bounded by `rollout.max_actor_restarts`:
  - an engine: `RolloutWorkers.wait` keeps one `watch()` call open per engine, so the driver
    notices a death while it waits on groups; `on_engine_lost` (the run's, controller/loop.py)
    starts a replacement with the current weights and every worker's router gets it. Requests
    that died with the engine are resubmitted by the routers (rollout/client.py).
  - a rollout worker: noticed the same way (or when `take` of one of its groups fails); a
    replacement starts, and `take` of any group of the dead one raises `WorkerLost`. Its
    unfinished groups are lost, and so are the finished ones whose prompts live in its object
    store (an object dies with the process that put it): the caller rolls those samples out
    again (`outcome_lost`), same slots and seeds. A worker that dies after the trainers were
    given its groups' prompts fails that update (the trainers cannot read them).
"""
from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import ray

from mmrl.data.quarantine import BadSample
from mmrl.data.sample import Sample
from mmrl.processors.base import ProcessedPrompt, PromptRef, process_sample
from mmrl.rollout.agent_loops import AgentContext
from mmrl.rollout.client import Router
from mmrl.rollout.trainer_view import to_trainer_view
from mmrl.rollout.types import SamplingConfig, Trajectory

# Processed held-out prompts kept per worker (evaluation reruns the same samples every time).
EVAL_CACHE_SIZE = 4096


@dataclass
class GroupOutcome:
    """One sample's group, or why it has none."""

    slot: int  # the prompt's position in the step's batch
    key: str
    prompt: PromptRef | None = None  # None for evaluation rollouts (nothing to train on)
    trajectories: list[Trajectory] = field(default_factory=list)
    failure: BadSample | None = None
    worker: int = 0
    incarnation: int = -1  # which actor of slot `worker` made it (set by RolloutWorkers.take)


class ActorRestartsExhausted(RuntimeError):
    """More engine or rollout-worker deaths than rollout.max_actor_restarts: the run stops; its
    newest checkpoint resumes it (the CLI exits with 75, like a trainer rank's RunStopped)."""

    exit_code = 75


class WorkerLost(RuntimeError):
    """The rollout worker running a group died; a replacement is up, the group must be resubmitted."""

    def __init__(self, worker: int, incarnation: int, cause: BaseException):
        super().__init__(f"rollout worker {worker} died: {type(cause).__name__}: {cause}")
        self.worker, self.incarnation = worker, incarnation


def absolute_plugin_spec(spec: str) -> str:
    """`path/file.py:attr` made absolute (a Ray worker may run in another directory)."""
    target, sep, attr = spec.rpartition(":")
    if sep and (target.endswith(".py") or "/" in target):
        return f"{os.path.abspath(os.path.expanduser(target))}:{attr}"
    return spec


class RolloutWorker:
    """Runs agent loops (see module docstring); used as a Ray actor through `RolloutWorkers`."""

    def __init__(self, index: int, engines: Sequence[Any], processor_spec: dict[str, Any], agent_loop: str,
                 agent_loop_args: dict[str, Any], max_requests_per_engine: int, replaces_engines: bool = False):
        from mmrl import registry
        from mmrl.processors import build_processor

        self.index = index
        self.processor = build_processor(**processor_spec)
        self.loop = registry.resolve("agent_loop", agent_loop)
        self.loop_name, self.loop_args = agent_loop, dict(agent_loop_args)
        self.engines = list(engines)
        self.max_requests_per_engine = max_requests_per_engine
        self.replaces_engines = replaces_engines
        self.router: Router | None = None
        self._eval_cache: dict[str, ProcessedPrompt] = {}

    async def ready(self) -> int:
        # The router's semaphores belong to the actor's event loop: create it there.
        self.router = Router(self.engines, self.max_requests_per_engine, replaces_engines=self.replaces_engines)
        return os.getpid()

    async def watch(self) -> None:
        """Never returns: the driver keeps one call open per worker, which fails when it dies."""
        await asyncio.Event().wait()

    def replace_engine(self, engine: int, handle: Any) -> None:
        """Engine `engine` died and `handle` runs in its place (with the current weights)."""
        self.engines[engine] = handle
        if self.router is not None:
            self.router.replace_engine(engine, handle)

    def _process(self, sample: Sample, cache: bool) -> ProcessedPrompt | BadSample:
        if cache and sample.key in self._eval_cache:
            return self._eval_cache[sample.key]
        prompt = process_sample(self.processor, sample)
        if cache and isinstance(prompt, ProcessedPrompt) and len(self._eval_cache) < EVAL_CACHE_SIZE:
            self._eval_cache[sample.key] = prompt
        return prompt

    async def rollout_group(self, sample: Sample, slot: int, sampling: SamplingConfig,
                            evaluation: bool = False) -> GroupOutcome:
        """One group; `evaluation`: the processed prompt is cached (held-out samples come back
        every evaluation) and no trainer input is kept."""
        assert self.router is not None, "call ready() first"
        prompt = self._process(sample, evaluation)
        if isinstance(prompt, BadSample):
            return GroupOutcome(slot, sample.key, failure=prompt, worker=self.index)
        trajectories = await asyncio.gather(*[self._trajectory(sample, prompt, slot, j, sampling)
                                               for j in range(sampling.n)])
        for t in trajectories:
            if evaluation:
                t.new_media, t.own_prompt = {}, None  # nothing to train on: the images stay here
                continue
            base = prompt
            if t.own_prompt is not None:
                base = dataclasses.replace(self.processor.expand(t.own_prompt), key=sample.key)
                t.prompt_ref = PromptRef(sample.key, base.num_tokens, ray.put(dataclasses.replace(base, vllm_input={})))
                t.own_prompt = None
            to_trainer_view(self.processor, base, t)
        ref = None if evaluation else PromptRef(
            sample.key, prompt.num_tokens, ray.put(dataclasses.replace(prompt, vllm_input={})))
        return GroupOutcome(slot, sample.key, prompt=ref, trajectories=list(trajectories), worker=self.index)

    async def _trajectory(self, sample: Sample, prompt: ProcessedPrompt, slot: int, member: int,
                          sampling: SamplingConfig) -> Trajectory:
        assert self.router is not None
        request = sampling.for_trajectory(slot, member)
        client = self.router.client(request.request_key)
        ctx = AgentContext(client=client, sampling=request, processor=self.processor, group_index=member,
                           args=self.loop_args)
        t0 = time.time()
        try:
            trajectory = await self.loop(ctx, sample, prompt)
        except Exception as e:
            raise RuntimeError(f"agent loop {self.loop_name!r} raised on sample {sample.key!r} (group member "
                               f"{member}): {type(e).__name__}: {e}") from e
        finally:
            client.close()
        if not isinstance(trajectory, Trajectory):
            raise TypeError(f"agent loop {self.loop_name!r} returned {type(trajectory).__name__}, not a Trajectory")
        trajectory.prompt_index = slot
        trajectory.timings.update({"engine": client.engine if client.engine is not None else -1,
                                   "start": t0, "end": time.time(), "requests": client.requests})
        return trajectory

    def engine_windows(self) -> list[list[tuple[float, float]]]:
        """This worker's busy windows per engine since the last call."""
        assert self.router is not None
        return self.router.take_windows()

    def router_stats(self) -> list[dict[str, float]]:
        assert self.router is not None
        return [{"in_flight_requests": float(x.in_flight_requests), "requests": float(x.requests),
                 "generated_tokens": float(x.generated_tokens), "resubmitted": float(x.resubmitted),
                 "lost": float(x.lost)}
                for x in self.router.load]


class RolloutWorkers:
    """The driver's handle on the rollout-worker actors (and the watch over the engines)."""

    def __init__(self, n: int, engines: list[Any], processor_spec: dict[str, Any], agent_loop: str,
                 agent_loop_args: dict[str, Any] | None = None, max_requests_per_engine: int = 256,
                 actor_options: dict[str, Any] | None = None, max_restarts: int = 0,
                 on_engine_lost: Callable[[int, BaseException], Any] | None = None):
        """`engines`: the run's list (replaced engines are written into it). `on_engine_lost(i,
        error)` returns a started replacement for engine i with the current weights; without it a
        dead engine is not replaced. `max_restarts`: rollout-worker replacements per run."""
        if n < 1:
            raise ValueError(f"rollout.num_workers must be >= 1, got {n}")
        self.engines = engines
        self.on_engine_lost = on_engine_lost
        self.max_restarts = max_restarts
        self.restarts = 0
        self._cls = ray.remote(RolloutWorker)
        self._options = {"num_cpus": 0, "max_concurrency": 4096, **(actor_options or {})}
        self._args = (processor_spec, absolute_plugin_spec(agent_loop), dict(agent_loop_args or {}),
                      max_requests_per_engine, on_engine_lost is not None)
        self.actors = [self._start(i) for i in range(n)]
        self._incarnation = list(range(n))  # per slot: which actor runs it now
        self._next_incarnation = n
        self.dead: set[int] = set()  # incarnations that died
        self._outstanding = [0] * n
        self._worker_of: dict[Any, tuple[int, int]] = {}  # ref -> (worker, incarnation)
        # an open watch() call -> ("engine", index, id(handle)) or ("worker", index, incarnation)
        self._watches: dict[Any, tuple[str, int, int]] = {}

    def _start(self, index: int) -> Any:
        return self._cls.options(**self._options).remote(index, list(self.engines), *self._args)

    def ready(self) -> list[int]:
        return ray.get([a.ready.remote() for a in self.actors])

    def submit(self, sample: Sample, slot: int, sampling: SamplingConfig, evaluation: bool = False) -> Any:
        """Queue one group; returns its ObjectRef (a `GroupOutcome`)."""
        w = min(range(len(self.actors)), key=lambda i: (self._outstanding[i], i))
        ref = self.actors[w].rollout_group.remote(sample, slot, sampling, evaluation)
        self._outstanding[w] += 1
        self._worker_of[ref] = (w, self._incarnation[w])
        return ref

    def take(self, ref: Any) -> GroupOutcome:
        """The outcome of a finished `submit` (after `wait` says it is ready). Raises `WorkerLost`
        (a replacement is running by then) if the worker died."""
        from ray.exceptions import RayActorError

        w, incarnation = self._worker_of.pop(ref)
        self._outstanding[w] -= 1
        try:
            out: GroupOutcome = ray.get(ref)
        except RayActorError as e:
            self._replace_worker(w, incarnation, e)
            raise WorkerLost(w, incarnation, e) from e
        if incarnation in self.dead:  # it finished, but its prompt objects died with its worker
            raise WorkerLost(w, incarnation, RuntimeError("the worker died after this group finished"))
        out.incarnation = incarnation
        return out

    def outcome_lost(self, out: GroupOutcome) -> bool:
        """True if the worker that made `out` died: its prompt objects died with it."""
        return out.incarnation in self.dead

    def _replace_worker(self, w: int, incarnation: int, error: BaseException) -> bool:
        if incarnation != self._incarnation[w]:
            return False  # replaced already (its watch or an earlier group reported the death)
        self.dead.add(incarnation)
        self.restarts += 1
        if self.restarts > self.max_restarts:
            raise ActorRestartsExhausted(f"rollout worker {w} died ({type(error).__name__}: {error}); that is "
                               f"{self.restarts} rollout-worker deaths in this run, more than "
                               f"rollout.max_actor_restarts={self.max_restarts}. Look for the cause in the "
                               f"worker's log (Ray's logs/ folder), then rerun the command to resume from the "
                               f"newest checkpoint, or raise rollout.max_actor_restarts")
        print(f"[mmrl] rollout worker {w} died ({type(error).__name__}); starting a replacement "
              f"({self.restarts}/{self.max_restarts}) and rolling its groups out again")
        try:
            ray.kill(self.actors[w], no_restart=True)
        except Exception:  # gone already
            pass
        self.actors[w] = self._start(w)
        ray.get(self.actors[w].ready.remote())
        self._incarnation[w] = self._next_incarnation
        self._next_incarnation += 1
        return True

    # ---- watching the engines and workers -----------------------------------------------------
    def wait(self, refs: list[Any], num_returns: int = 1, timeout: float | None = None) -> list[Any]:
        """`ray.wait` on group refs that also wakes up when an engine or a worker dies: it is
        replaced, then the refs ready so far are returned (possibly none)."""
        if not refs:
            return []
        self._arm_watches()
        watches = list(self._watches)
        ready, _ = ray.wait(refs + watches, num_returns=min(num_returns, len(refs)), timeout=timeout)
        self.replace_dead(timeout=0)
        watching = set(watches)
        return [r for r in ready if r not in watching]

    def replace_dead(self, timeout: float = 0) -> int:
        """Replace the engines and workers that died (waiting up to `timeout` s for a death to
        show); how many were replaced."""
        self._arm_watches()
        fired = ray.wait(list(self._watches), num_returns=1, timeout=timeout)[0] if self._watches else []
        if fired:
            fired = ray.wait(list(self._watches), num_returns=len(self._watches), timeout=0)[0]
        replaced = 0
        for ref in fired:
            replaced += self._on_watch(ref, *self._watches.pop(ref))
        return replaced

    def _arm_watches(self) -> None:
        watched = {(kind, key) for kind, _, key in self._watches.values()}
        if self.on_engine_lost is not None:  # engines are replaced only by a run that can restart them
            for i, engine in enumerate(self.engines):
                if ("engine", id(engine)) not in watched:
                    self._watches[engine.watch.remote()] = ("engine", i, id(engine))
        for w, actor in enumerate(self.actors):
            if ("worker", self._incarnation[w]) not in watched:
                self._watches[actor.watch.remote()] = ("worker", w, self._incarnation[w])

    def _on_watch(self, ref: Any, kind: str, index: int, key: int) -> int:
        from ray.exceptions import RayActorError

        try:
            ray.get(ref)
            return 0  # a clean shutdown
        except RayActorError as e:
            error: BaseException = e
        if kind == "worker":
            return int(self._replace_worker(index, key, error))
        if id(self.engines[index]) != key:
            return 0  # replaced already
        assert self.on_engine_lost is not None
        self.engines[index] = self.on_engine_lost(index, error)
        ray.get([a.replace_engine.remote(index, self.engines[index]) for a in self.actors])
        return 1

    def forget(self, refs: list[Any]) -> None:
        """Refs whose outcomes will never be taken (an abandoned rollout window)."""
        for ref in refs:
            entry = self._worker_of.pop(ref, None)
            if entry is not None:
                self._outstanding[entry[0]] -= 1

    def engine_windows(self, n_engines: int) -> list[list[tuple[float, float]]]:
        """Busy windows per engine (all workers) since the last call."""
        merged: list[list[tuple[float, float]]] = [[] for _ in range(n_engines)]
        for per_worker in ray.get([a.engine_windows.remote() for a in self.actors]):
            for i, windows in enumerate(per_worker):
                merged[i] += windows
        return [merge_windows(w) for w in merged]

    def close(self) -> None:
        """Kill the worker actors. They own the prompts and response inputs they put in the object
        store, which die with them: close only once the trainers have read those."""
        for a in self.actors:
            ray.kill(a)


def merge_windows(windows: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of (start, end) intervals as disjoint intervals, in order."""
    out: list[tuple[float, float]] = []
    for a, b in sorted(windows):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out
