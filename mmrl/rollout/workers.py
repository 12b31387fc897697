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
"""
from __future__ import annotations

import asyncio
import dataclasses
import os
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

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


def absolute_plugin_spec(spec: str) -> str:
    """`path/file.py:attr` made absolute (a Ray worker may run in another directory)."""
    target, sep, attr = spec.rpartition(":")
    if sep and (target.endswith(".py") or "/" in target):
        return f"{os.path.abspath(os.path.expanduser(target))}:{attr}"
    return spec


class RolloutWorker:
    """Runs agent loops (see module docstring); used as a Ray actor through `RolloutWorkers`."""

    def __init__(self, index: int, engines: Sequence[Any], processor_spec: dict[str, Any], agent_loop: str,
                 agent_loop_args: dict[str, Any], max_requests_per_engine: int):
        from mmrl import registry
        from mmrl.processors import build_processor

        self.index = index
        self.processor = build_processor(**processor_spec)
        self.loop = registry.resolve("agent_loop", agent_loop)
        self.loop_name, self.loop_args = agent_loop, dict(agent_loop_args)
        self.engines = list(engines)
        self.max_requests_per_engine = max_requests_per_engine
        self.router: Router | None = None
        self._eval_cache: dict[str, ProcessedPrompt] = {}

    async def ready(self) -> int:
        # The router's semaphores belong to the actor's event loop: create it there.
        self.router = Router(self.engines, self.max_requests_per_engine)
        return os.getpid()

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
                 "generated_tokens": float(x.generated_tokens), "resubmitted": float(x.resubmitted)}
                for x in self.router.load]


class RolloutWorkers:
    """The driver's handle on the rollout-worker actors."""

    def __init__(self, n: int, engines: Sequence[Any], processor_spec: dict[str, Any], agent_loop: str,
                 agent_loop_args: dict[str, Any] | None = None, max_requests_per_engine: int = 256,
                 actor_options: dict[str, Any] | None = None):
        if n < 1:
            raise ValueError(f"rollout.num_workers must be >= 1, got {n}")
        cls = ray.remote(RolloutWorker)
        options = {"num_cpus": 0, "max_concurrency": 4096, **(actor_options or {})}
        self.actors = [cls.options(**options).remote(i, list(engines), processor_spec, absolute_plugin_spec(agent_loop),
                                                     dict(agent_loop_args or {}), max_requests_per_engine)
                       for i in range(n)]
        self._outstanding = [0] * n
        self._worker_of: dict[Any, int] = {}

    def ready(self) -> list[int]:
        return ray.get([a.ready.remote() for a in self.actors])

    def submit(self, sample: Sample, slot: int, sampling: SamplingConfig, evaluation: bool = False) -> Any:
        """Queue one group; returns its ObjectRef (a `GroupOutcome`)."""
        w = min(range(len(self.actors)), key=lambda i: (self._outstanding[i], i))
        ref = self.actors[w].rollout_group.remote(sample, slot, sampling, evaluation)
        self._outstanding[w] += 1
        self._worker_of[ref] = w
        return ref

    def take(self, ref: Any) -> GroupOutcome:
        """The outcome of a finished `submit` (after `ray.wait` says it is ready)."""
        self._outstanding[self._worker_of.pop(ref)] -= 1
        return ray.get(ref)

    def forget(self, refs: list[Any]) -> None:
        """Refs whose outcomes will never be taken (an abandoned rollout window)."""
        for ref in refs:
            w = self._worker_of.pop(ref, None)
            if w is not None:
                self._outstanding[w] -= 1

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
