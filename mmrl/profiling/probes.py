"""What-if probes: the cost of a few samples' stages with the current and a proposed setting.

The same raw samples are decoded (and processed, and pickled) with the old and the new setting,
alternating sample by sample and repeated, so machine noise hits both sides alike. Only ratios
(new / old per stage) are used downstream (mmrl.profiling.advice.predict_change), which makes the
probe indifferent to running in the main process instead of a loader worker.
"""
from __future__ import annotations

import dataclasses
import pickle
import time
from typing import Any

from mmrl.data.decode import DecodeOptions, decode_sample

PROBE_STAGES = ("image_decode", "video_decode", "processor", "serialise")


def _one(raw: dict[str, Any], options: DecodeOptions, processor: Any) -> dict[str, float] | None:
    timings: dict[str, Any] = {}
    try:
        sample = decode_sample(raw, options, timings)
    except Exception:  # a bad sample is no evidence either way
        return None
    out = {"image_decode": sum(i["s"] for i in timings.get("images", [])),
           "video_decode": sum(v["s"] for v in timings.get("videos", []))}
    start = time.perf_counter()
    try:
        prompt = processor(sample)
    except Exception:  # refused or failed: training would quarantine it, so no evidence either
        return None
    middle = time.perf_counter()
    pickle.dumps(prompt, protocol=pickle.HIGHEST_PROTOCOL)
    out["processor"], out["serialise"] = middle - start, time.perf_counter() - middle
    return out


def probe(raws: list[dict[str, Any]], options: DecodeOptions, processor: Any, *,
          decode_changes: dict[str, Any] | None = None, new_processor: Any = None,
          repeats: int = 2) -> dict[str, Any]:
    """{"old": {stage: mean s}, "new": {stage: mean s}, "samples": n} over `raws`, old and new
    interleaved. `decode_changes` are DecodeOptions fields; `new_processor` replaces the processor."""
    new_options = dataclasses.replace(options, **(decode_changes or {}))
    variants = {"old": (options, processor), "new": (new_options, new_processor or processor)}
    for opts, proc in variants.values():  # first calls pay imports and caches
        if raws:
            _one(raws[0], opts, proc)
    sums: dict[str, dict[str, float]] = {v: dict.fromkeys(PROBE_STAGES, 0.0) for v in variants}
    counted = 0
    for _ in range(repeats):
        for raw in raws:
            pair = {v: _one(raw, *variants[v]) for v in variants}
            if pair["old"] is None or pair["new"] is None:
                continue
            counted += 1
            for v, stages in pair.items():
                for s, seconds in stages.items():
                    sums[v][s] += seconds
    n = max(counted, 1)
    return {"old": {s: t / n for s, t in sums["old"].items()},
            "new": {s: t / n for s, t in sums["new"].items()}, "samples": counted // max(repeats, 1)}
