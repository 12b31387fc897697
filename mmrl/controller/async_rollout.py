"""Async rollout (`rollout.mode: async`): generation goes on while the trainer trains.

`AsyncRollout` keeps a bounded window of groups drawn from the stream but not yet trained on:
in the rollout workers, being scored, or scored and waiting in the buffer. Admission is tied to
the trainer's version: with B = prompts_per_step, at most (versions since start + k + 1) * B
groups are ever admitted beyond those dropped, so a group is admitted at most k versions before
the step that can train on it, and the window never holds more than (k + 1) * B groups
(`rollout.max_buffered_groups` caps it further). A training step `take`s B scored groups, oldest
first, as soon as they are ready; the engines keep generating the rest through the update (a
weight update freezes, aborts or waits for what is in flight, see docs/rollout.md), and the
window admits the next B once the new weights are in (`on_new_version`).

Staleness is counted in weight versions, from the OLDEST token of a trajectory: a group whose
oldest token is more than `max_staleness` versions behind the trainer is dropped and counted
(`async/dropped_stale_groups`). With DAPO dynamic sampling on, groups whose rewards are all equal
are dropped from the buffer too, and drawing goes on until the batch has enough informative
groups.

Checkpoints stay exact: the resume state is the stream cursor from just before the oldest
sample not yet consumed, plus the positions after it that were consumed (trained, dropped or
refused). A resumed run regenerates exactly the samples that were in flight, and no other.
"""
from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

from mmrl.controller.metrics import rollout_metrics, weight_sync_metrics
from mmrl.controller.rollout_log import log_rollouts
from mmrl.data.sample import Sample
from mmrl.processors import PromptRef
from mmrl.rollout.types import SamplingConfig, Trajectory
from mmrl.rollout.workers import WorkerLost

# The driver checks the rollout and reward workers this often while it waits for a batch.
POLL_S = 0.05


@dataclass
class _Draw:
    """A sample drawn from the stream, from submission to being consumed."""

    index: int  # position in the run's draw order
    sample: Sample
    ref: Any = None  # the rollout worker's GroupOutcome
    prompt: PromptRef | None = None
    group: list[Trajectory] | None = None
    reward: Any = None  # RewardHandle
    scored: bool = False
    keep: bool = True  # reward on_error=drop_group says no
    result: Any = None  # GroupResult
    outcome: Any = None  # the GroupOutcome, to tell whether it died with its worker


class AsyncRollout:
    """The rollout window of an async run (see module docstring)."""

    def __init__(self, rt: Any, batches: Any, *, batch_size: int, capacity: int, max_staleness: int,
                 informative_only: bool, resume: dict[str, Any] | None = None, seed: int = 0, version: int = 0):
        self.rt, self.batches = rt, batches
        self.batch_size, self.capacity = batch_size, capacity
        self.max_staleness, self.informative_only = max_staleness, informative_only
        self._start_version, self._version = version, version
        self._trained = 0  # groups taken for training by this window
        self.sampling = SamplingConfig(**{**rt.sampling.__dict__,
                                          "seed": seed if rt.cfg.rollout.seed_per_step else None})
        # Draw indices count from the cursor this run started at (the checkpoint's, on resume).
        self._draws: dict[int, _Draw] = {}  # drawn, not yet consumed
        self._next_index = 0
        self._cursor_before: dict[int, dict[str, Any]] = {}  # stream state just before draw i
        self._consumed: set[int] = set()  # consumed draws newer than the oldest open one
        self._skip: set[int] = set(resume.get("skip", [])) if resume else set()

    # ---- the window ----------------------------------------------------------------------------
    def _draw(self) -> None:
        index = self._next_index
        self._cursor_before[index] = self.batches.stream.state_dict()
        sample = self.batches.refill()
        self._next_index += 1
        if index in self._skip:  # consumed before the checkpoint this run resumed from
            self._skip.discard(index)
            self._consume(index)
            return
        draw = _Draw(index, sample)
        draw.ref = self.rt.workers.submit(sample, index, self.sampling)
        self._draws[index] = draw

    def _admissible(self) -> int:
        """How many more groups may be drawn now (see the module docstring)."""
        budget = (self._version - self._start_version + self.max_staleness + 1) * self.batch_size
        return min(self.capacity - len(self._draws), budget - self._trained - len(self._draws))

    def _fill(self) -> None:
        for _ in range(max(0, self._admissible())):
            self._draw()

    def on_new_version(self, version: int) -> None:
        """The engines run `version` now: admit the groups it makes room for."""
        self._version = version
        self._fill()

    def _oldest_open(self) -> int:
        return min(self._draws) if self._draws else self._next_index

    def _consume(self, index: int) -> None:
        self._draws.pop(index, None)
        self._consumed.add(index)
        oldest = self._oldest_open()  # what no checkpoint can need any more
        for i in [i for i in self._cursor_before if i < oldest]:
            del self._cursor_before[i]
        self._consumed = {i for i in self._consumed if i > oldest}

    def _advance(self) -> None:
        """Take in finished rollouts (to the reward workers) and finished scores."""
        refs = [d.ref for d in self._draws.values() if d.ref is not None]
        if refs:
            ready = self.rt.workers.wait(refs, num_returns=len(refs), timeout=POLL_S)
            by_ref = {d.ref: d for d in self._draws.values() if d.ref is not None}
            for ref in ready:
                draw = by_ref[ref]
                try:
                    out = self.rt.workers.take(ref)
                except WorkerLost:
                    self._redo(draw)
                    continue
                draw.ref = None
                draw.outcome = out
                if out.failure is not None:
                    self.batches.record_failure(out.failure)
                    self._consume(draw.index)
                    continue
                self.batches.record_success()
                draw.prompt, draw.group = out.prompt, out.trajectories
                texts = [self.rt.processor.decode(t.response_ids) for t in draw.group]
                draw.reward = self.rt.rewards.submit(draw.sample, texts, [list(t.response_ids) for t in draw.group])
        else:
            time.sleep(POLL_S)
        self._redo_lost_outcomes()
        self.rt.rewards.poll()
        for draw in list(self._draws.values()):
            if draw.reward is not None and not draw.scored and draw.reward.done:
                result = self.rt.rewards.collect([draw.reward])[0]
                result.apply(draw.group)
                draw.scored, draw.keep = True, result.keep
                draw.result = result

    def _redo(self, draw: _Draw) -> None:
        """Roll `draw` out again (its worker died); a score that still comes for it is ignored."""
        draw.prompt = draw.group = draw.reward = draw.result = draw.outcome = None
        draw.scored, draw.keep = False, True
        draw.ref = self.rt.workers.submit(draw.sample, draw.index, self.sampling)

    def _redo_lost_outcomes(self) -> None:
        """Roll out again the finished groups whose prompts died with their rollout worker."""
        for draw in list(self._draws.values()):
            if draw.outcome is not None and self.rt.workers.outcome_lost(draw.outcome):
                self._redo(draw)

    def _staleness(self, draw: _Draw, version: int) -> int:
        oldest = min((t.weight_version for t in draw.group or [] if t.weight_version >= 0), default=version)
        return version - oldest

    def take(self, n: int, version: int) -> tuple[list[_Draw], dict[str, float]]:
        """`n` scored groups, oldest first, none staler than max_staleness at trainer `version`."""
        t0 = time.time()
        self._version = version
        dropped = Counter()
        while True:
            self._fill()
            self.rt.workers.replace_dead(timeout=0)
            self._redo_lost_outcomes()
            ready: list[_Draw] = []
            for index in sorted(self._draws):
                draw = self._draws[index]
                if not draw.scored:
                    continue
                if not draw.keep:
                    dropped["reward_failed"] += 1
                    self._consume(index)
                elif self._staleness(draw, version) > self.max_staleness:
                    dropped["stale"] += 1
                    self._consume(index)
                elif self.informative_only and len({t.reward for t in draw.group}) < 2:
                    dropped["uninformative"] += 1
                    self._consume(index)
                else:
                    ready.append(draw)
            if len(ready) >= n:
                break
            self._advance()
        batch = ready[:n]
        for draw in batch:
            self._consume(draw.index)
        self._trained += len(batch)
        staleness = [self._staleness(d, version) for d in batch]
        metrics = {
            "async/wait_s": time.time() - t0,
            "async/staleness_mean": float(np.mean(staleness)),
            "async/staleness_max": float(max(staleness)),
            "async/dropped_stale_groups": float(dropped["stale"]),
            "async/dropped_uninformative_groups": float(dropped["uninformative"]),
            "async/window_groups": float(len(self._draws)),
            "async/buffered_ready_groups": float(len(ready) - n),
        }
        for k in range(self.max_staleness + 1):
            metrics[f"async/staleness_share/{k}"] = sum(s == k for s in staleness) / len(staleness)
        return batch, metrics

    # ---- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Resume here: the cursor before the oldest open draw, and the consumed draws after it
        (positions relative to that cursor), which a resumed run skips."""
        oldest = self._oldest_open()
        cursor = self._cursor_before.get(oldest) or self.batches.stream.state_dict()
        skip = sorted(i - oldest for i in self._consumed if i > oldest)
        return {"mode": "async", "cursor": cursor, "skip": skip}

    def close(self) -> None:
        """Abandon the window (a rollback rewinds the data): its groups are never taken."""
        self.rt.workers.forget([d.ref for d in self._draws.values() if d.ref is not None])
        self._draws.clear()


def run_async_step(rt: Any, window: AsyncRollout, advantage_fn: Any, spans: Any,
                   step: int) -> tuple[dict[str, float], list[Sample]]:
    """One training step of an async run: take a batch from the window (generation goes on),
    update (decoupled objective with π_prox the policy before the update, see learn.py), sync weights
    into the running engines."""
    from mmrl.controller.learn import update_policy
    from mmrl.rewards.report import RewardReport

    cfg = rt.cfg
    with spans("rollout"):  # the trainer's wait for a ready batch
        batch, metrics = window.take(cfg.rollout.prompts_per_step, rt.weight_version)
    groups = [d.group for d in batch]
    metrics.update(RewardReport.from_results([d.result for d in batch]).metrics())
    metrics.update(rollout_metrics(groups))
    log_rollouts(rt, step, [d.sample for d in batch], [d.prompt for d in batch], groups)
    metrics.update(update_policy(rt.trainers, cfg, [d.prompt for d in batch], groups, advantage_fn, spans, step))
    with spans("weight_sync"):
        sync = rt.push_weights()
    metrics.update({**weight_sync_metrics(sync), "weight_version": float(rt.weight_version)})
    window.on_new_version(rt.weight_version)
    if rt.monitor is not None:
        metrics.update(rt.monitor.metrics())
    metrics.update(rt.restart_metrics())
    # the engines' busy windows since the last step (trace tracks rollout/engine_<i>)
    for engine, windows in enumerate(rt.workers.engine_windows(len(rt.engines))):
        for start, end in windows:
            spans.add(f"rollout/engine_{engine}", start, end - start)
    return metrics, [d.sample for d in batch]
