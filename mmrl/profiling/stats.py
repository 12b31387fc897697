"""Latency statistics of one pipeline stage: count, total, mean/p50/p95/max, throughput."""
from __future__ import annotations

from typing import Any, Sequence


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of already sorted values, linearly interpolated (numpy's default)."""
    if not sorted_values:
        return 0.0
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def stage_stats(name: str, side: str, durations_s: Sequence[float], *, work: bool = True,
                nbytes: int | None = None, bytes_time_s: float | None = None) -> dict[str, Any]:
    """One row of report["stages"] (see report.schema.json). `durations_s`: one per item (sample,
    image, video, shard). `nbytes` over `bytes_time_s` (default: the stage's total) gives MB/s.
    `share` is filled in later, once every stage's total is known."""
    values = sorted(float(d) for d in durations_s)
    total = sum(values)
    count = len(values)
    ms = 1e3
    mb_time = total if bytes_time_s is None else bytes_time_s
    return {
        "name": name, "side": side, "work": work, "count": count, "total_s": total,
        "mean_ms": total / count * ms if count else 0.0,
        "p50_ms": percentile(values, 50) * ms, "p95_ms": percentile(values, 95) * ms,
        "max_ms": (values[-1] if values else 0.0) * ms,
        "items_per_s": count / total if total > 0 else None,
        "bytes": nbytes,
        "mb_per_s": nbytes / 1e6 / mb_time if nbytes is not None and mb_time > 0 else None,
        "share": None,
    }


def fill_shares(stages: list[dict[str, Any]]) -> float:
    """Set each work stage's share of all work seconds (non-work stages, like waiting, keep None).
    Returns the total work seconds."""
    total = sum(s["total_s"] for s in stages if s["work"])
    for s in stages:
        if s["work"]:
            s["share"] = s["total_s"] / total if total > 0 else 0.0
    return total
