"""One step's rollout from the driver's side: samples out to the rollout workers, groups back,
each group to the reward workers the moment it is final, refused samples replaced.

The driver never runs the processor or an agent loop: it hands out (sample, slot) pairs and
collects `GroupOutcome`s as they finish (rollout/workers.py). A slot whose sample the processor
refused gets the next sample of the stream (same slot, so the batch keeps its size and its
seeds); with two refusals in one step, which refill lands in which slot follows the order the
refusals arrive in.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

import ray

from mmrl.data.quarantine import BadSample
from mmrl.data.sample import Sample
from mmrl.processors import PromptRef
from mmrl.rewards.streaming import RewardStream
from mmrl.rollout.types import SamplingConfig, Trajectory
from mmrl.rollout.workers import WorkerLost
from mmrl.utils.timing import StepSpans


@dataclass
class Rollout:
    """A finished rollout: per slot the sample, its prompt (the trainer side, by reference) and its group."""

    samples: list[Sample]
    prompts: list[PromptRef]
    groups: list[list[Trajectory]]
    failures: list[BadSample]


def run_rollout(workers: Any, samples: list[Sample], sampling: SamplingConfig, *,
                on_group: Callable[[int, Sample, list[Trajectory]], None] | None = None,
                refill: Callable[[], Sample] | None = None,
                on_failure: Callable[[BadSample], None] | None = None,
                on_redo: Callable[[int], None] | None = None,
                evaluation: bool = False) -> Rollout:
    """Roll out one group per sample. `on_group(slot, sample, group)` is called as each group
    finishes; a refused sample is reported to `on_failure` and, with `refill`, replaced by
    `refill()` in the same slot (without: its slot is dropped from the result). `evaluation`:
    prompts cached in the workers, no trainer inputs (`Rollout.prompts` are None).

    A rollout worker that dies costs nothing but time: its unfinished groups are resubmitted, and
    so are its finished ones (their prompts died with it; `on_redo(slot)` is told first), in the
    same slots with the same seeds. Dead engines are replaced while this waits (`workers.wait`)."""
    samples = list(samples)
    pending = {workers.submit(s, slot, sampling, evaluation): slot for slot, s in enumerate(samples)}
    prompts: list[PromptRef | None] = [None] * len(samples)
    groups: list[list[Trajectory] | None] = [None] * len(samples)
    made_by: dict[int, Any] = {}  # slot -> its outcome, while it may still be lost with its worker
    failures: list[BadSample] = []

    def redo_lost_outcomes() -> None:
        for lost in [s for s, o in made_by.items() if workers.outcome_lost(o)]:
            del made_by[lost]
            prompts[lost] = groups[lost] = None
            if on_redo is not None:
                on_redo(lost)
            pending[workers.submit(samples[lost], lost, sampling, evaluation)] = lost

    while pending:
        for ref in workers.wait(list(pending), num_returns=1):
            slot = pending.pop(ref)
            try:
                out = workers.take(ref)
            except WorkerLost:
                pending[workers.submit(samples[slot], slot, sampling, evaluation)] = slot
                continue
            if out.failure is not None:
                failures.append(out.failure)
                if on_failure is not None:
                    on_failure(out.failure)
                if refill is not None:
                    samples[slot] = refill()
                    pending[workers.submit(samples[slot], slot, sampling, evaluation)] = slot
                continue
            prompts[slot], groups[slot] = out.prompt, out.trajectories
            if not evaluation:  # evaluation outcomes hold nothing in the worker's object store
                made_by[slot] = out
            if on_group is not None:
                on_group(slot, samples[slot], out.trajectories)
        redo_lost_outcomes()
        if not pending and workers.replace_dead(timeout=0):  # a death that showed only now
            redo_lost_outcomes()
    kept = [i for i, g in enumerate(groups) if g is not None]
    return Rollout(samples=[samples[i] for i in kept], prompts=[prompts[i] for i in kept],  # type: ignore[misc]
                   groups=[groups[i] for i in kept], failures=failures)  # type: ignore[misc]


class EngineMonitor:
    """Per-step engine numbers from the engines' own counters (differences between reads)."""

    def __init__(self, engines: list[Any]):
        self.engines = engines
        self._last: list[dict[str, float]] = [{} for _ in engines]

    def forget(self, index: int) -> None:
        """Engine `index` was replaced: its counters start again from zero."""
        self._last[index] = {}

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for i, now in enumerate(ray.get([e.stats.remote(reset_peaks=True) for e in self.engines])):
            last = self._last[i]
            tokens = now["generated_tokens"] - last.get("generated_tokens", 0.0)
            busy = now["busy_s"] - last.get("busy_s", 0.0)
            alive = now["alive_s"] - last.get("alive_s", 0.0)
            out.update({
                f"rollout/engine_{i}/tokens_per_busy_s": tokens / busy if busy > 0 else 0.0,
                f"rollout/engine_{i}/idle_share": max(0.0, 1.0 - busy / alive) if alive > 0 else 0.0,
                f"rollout/engine_{i}/requests_in_flight_peak": now["max_in_flight"],
                f"rollout/engine_{i}/queue_waiting_peak": now.get("waiting_peak", 0.0),
                f"rollout/engine_{i}/kv_cache_usage_peak": now.get("kv_cache_usage_peak", 0.0),
                f"rollout/engine_{i}/pause_s": now["pause_s"] - last.get("pause_s", 0.0),
            })
            self._last[i] = now
        return out


def rollout_and_score_groups(rt: Any, samples: list[Sample], spans: StepSpans, *,
                             refill: Callable[[], Sample] | None,
                             on_failure: Callable[[BadSample], None] | None) -> tuple[Rollout, Any]:
    """Roll out a training batch and score every group as it finishes. Returns the rollout and
    the reward report (the "reward" span is only the wait left after the rollout)."""
    stream = RewardStream(rt.rewards, samples, decode=rt.processor.decode)

    def on_group(slot: int, sample: Sample, group: list[Trajectory]) -> None:
        stream.replace_sample(slot, sample)
        stream.submit([slot], [group])

    t_rollout = time.time()
    with spans("rollout"):
        rollout = run_rollout(rt.workers, samples, rt.sampling, on_group=on_group, refill=refill,
                              on_failure=on_failure, on_redo=stream.withdraw)
    for engine, windows in enumerate(rt.workers.engine_windows(len(rt.engines))):
        for start, end in windows:
            spans.add(f"rollout/engine_{engine}", max(start, t_rollout), max(0.0, end - max(start, t_rollout)))
    with spans("reward"):
        report = stream.finish(rollout.groups)
    return rollout, report
