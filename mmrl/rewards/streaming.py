"""Score groups while the rest of the rollout is still running.

The controller submits each group as soon as the rollout workers return it
(controller/rollout.py), so reward work overlaps the generation of the other groups. After the
rollout, `finish` scores whatever was not submitted, waits for everything, fills the
trajectories and returns the report, with the overlap measured:

    stream = RewardStream(pool, samples, decode=processor.decode)
    ... stream.submit([slot], [group]) as groups finish ...
    report = stream.finish(groups)           # report.metrics() includes the overlap timings

Timings are wall-clock (`time.time()`) stamps taken in the reward workers and the driver: fine
on one machine; across nodes they are as good as the clocks' sync.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Sequence

from mmrl.data.sample import Sample
from mmrl.rewards.pool import RewardHandle, RewardPool, episodes_of
from mmrl.rewards.report import GroupResult, RewardReport

__all__ = ["RewardStream", "overlap_seconds"]


def overlap_seconds(spans: Sequence[tuple[float, float]], start: float, end: float) -> float:
    """Length of the union of `spans` inside [start, end] (several workers may score at once)."""
    clipped = sorted((max(a, start), min(b, end)) for a, b in spans if min(b, end) > max(a, start))
    total, cur_a, cur_b = 0.0, None, None
    for a, b in clipped:
        if cur_b is None or a > cur_b:
            if cur_b is not None:
                total += cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    if cur_b is not None:
        total += cur_b - cur_a
    return total


class RewardStream:
    """One step's scoring, fed group by group while the rollout runs (see module docstring)."""

    def __init__(self, pool: RewardPool, samples: Sequence[Sample],
                 decode: Callable[[list[int]], str] | None = None):
        self.pool = pool
        self.samples = list(samples)
        self.decode = decode
        self.rollout_started = time.time()
        self._handles: dict[int, RewardHandle] = {}
        self._reported: dict[int, list[list[int]]] = {}  # prompt index -> response ids as reported

    def _texts(self, group: Sequence[Any]) -> list[str]:
        return [self.decode(t.response_ids) if self.decode else t.text for t in group]

    def replace_sample(self, index: int, sample: Sample) -> None:
        """The sample of slot `index` was refused and replaced before its group was submitted."""
        if index in self._handles and self.samples[index] is not sample:
            raise RuntimeError(f"the group of prompt {index} was already submitted; its sample cannot change")
        self.samples[index] = sample

    def withdraw(self, index: int) -> None:
        """Forget the group submitted for slot `index` (it is being rolled out again); its score,
        if it still comes, is ignored."""
        self._handles.pop(index, None)
        self._reported.pop(index, None)

    def submit(self, indices: Sequence[int], groups: Sequence[Sequence[Any]]) -> None:
        """Queue the final groups of prompts `indices` (positions in the step's batch)."""
        if len(indices) != len(groups):
            raise ValueError(f"{len(indices)} prompt indices but {len(groups)} groups")
        for i, group in zip(indices, groups):
            if not 0 <= i < len(self.samples):
                raise IndexError(f"prompt index {i} is outside the batch of {len(self.samples)}")
            if i in self._handles:
                raise RuntimeError(f"the group of prompt {i} was submitted twice; submit each group once, "
                                   f"when it is final")
            ids = [list(t.response_ids) for t in group]
            self._reported[i] = ids
            self._handles[i] = self.pool.submit(self.samples[i], self._texts(group), ids, episodes_of(group))
        self.pool.poll()  # take in groups that finished meanwhile: keeps the workers' queues balanced

    def finish(self, groups: Sequence[Sequence[Any]], *, on_error: str | None = None) -> RewardReport:
        """Score the groups not reported yet, wait for all, fill the trajectories, return the report.

        `groups` holds every slot's final group; a submitted group must be unchanged (same
        responses), since it was scored as submitted.
        """
        rollout_ended = time.time()
        t0 = time.perf_counter()
        if len(groups) != len(self.samples):
            raise ValueError(f"{len(self.samples)} samples but {len(groups)} groups")
        for i, ids in self._reported.items():
            if [list(t.response_ids) for t in groups[i]] != ids:
                raise RuntimeError(f"the group of prompt {i} changed after it was submitted for scoring "
                                   f"(submit final groups only)")
        late = [i for i in range(len(groups)) if i not in self._handles]
        for i in late:
            self._handles[i] = self.pool.submit(self.samples[i], self._texts(groups[i]),
                                                [list(t.response_ids) for t in groups[i]], episodes_of(groups[i]))
        index_of = {id(h): i for i, h in self._handles.items()}
        results: list[GroupResult | None] = [None] * len(groups)
        for h, res in self.pool.as_completed(list(self._handles.values()), on_error=on_error):
            i = index_of[id(h)]
            res.apply(groups[i])
            results[i] = res
        done = [r for r in results if r is not None]
        report = RewardReport.from_results(done, time.perf_counter() - t0)
        spans = [(r.started_at, r.finished_at) for r in done
                 if r.started_at is not None and r.finished_at is not None]
        early = sum(1 for a, _ in spans if a < rollout_ended)
        report.timings = {
            # reward work hidden behind the rollout (wall seconds with at least one group scoring)
            "reward/overlap_with_rollout_s": overlap_seconds(spans, self.rollout_started, rollout_ended),
            # what the step still waits for once the rollout is over
            "reward/wait_after_rollout_s": report.seconds,
            "reward/groups_started_during_rollout": early / max(len(done), 1),
            "reward/groups_reported_early": float(len(self._reported)) / max(len(groups), 1),
        }
        return report
