"""What reward execution hands back: per-group results, failure records, the batch report.

Plain data only (no Ray), shared by the in-process scorer (`scorer.py`), the worker pool
(`pool.py`) and the rollout-overlapping stream (`streaming.py`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

__all__ = ["ON_ERROR_POLICIES", "WORKER", "FailureRecord", "RewardFailure", "GroupResult", "RewardReport",
           "describe_exception"]

ON_ERROR_POLICIES = ("zero", "drop_group", "stop")
WORKER = "<worker>"  # the reward name of a failure that lost the whole group (the worker died)


def describe_exception(e: BaseException) -> str:
    """"Type: message", even for an exception whose __str__ raises."""
    try:
        return f"{type(e).__name__}: {e}"
    except Exception:
        return type(e).__name__


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
    # wall-clock (time.time()) span of the scoring in the worker; None when the group was lost
    started_at: float | None = None
    finished_at: float | None = None

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
    errors: int = 0  # failed calls (exceptions, bad return values, lost workers), per response
    timeouts: int = 0  # calls abandoned or skipped after timeout_s, per response
    dropped_groups: int = 0  # groups with keep=False
    errors_by_reward: dict[str, int] = field(default_factory=dict)
    timeouts_by_reward: dict[str, int] = field(default_factory=dict)
    failures: list[FailureRecord] = field(default_factory=list)
    means: dict[str, float] = field(default_factory=dict)  # "reward/mean", "reward/<name>/<comp>"
    seconds: float = 0.0  # wall time of score() (streaming: the wait after the rollout ended)
    timings: dict[str, float] = field(default_factory=dict)  # overlap with the rollout (streaming.py)

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
        out.update(self.timings)
        return out
