"""The bottleneck call-out and data-driven advice of `mmrl profile-data` (docs/profiling.md).

Everything here is computed from the measurements. A pipeline of `w` loader workers and one
consumer is modelled by its per-sample work: W seconds in a worker (read, parse, decode) and M
seconds in the consumer (processor, serialise). On C cores the time per sample is

    T(W, M, w) = max(M, W / min(w, C), (W + M) / min(C, w + 1))      (w >= 1)
    T(W, M, 0) = W + M                                               (everything in one process)

A proposed change is predicted as measured_T x T(new) / T(old): the model only has to get the
ratio right. What the change does to W and M is not assumed either: a *probe* decodes and
processes the same few samples with the old and the new setting, interleaved, and the per-stage
ratios (new / old) are applied to the stage means of the run. A worker-count change is predicted
from the measured scaling curve: read directly when that count was measured, else from Amdahl's
law fitted to it, else from the model.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

WORKER_STAGES = ("shard_open", "shard_read", "tar_parse", "sample_parse", "image_decode", "video_decode")
CONSUMER_STAGES = ("processor", "serialise")
MIN_SHARE = 0.2  # a stage below this share of the work gets no advice of its own
MIN_SPEEDUP = 1.05  # predicted gains below this are noise, not advice
SATURATED = 0.85  # busy cores / usable cores above this = CPU-bound
PATCH_PIXELS = 28 * 28  # one merged Qwen-VL vision token


def model_time(worker_s: float, consumer_s: float, workers: int, cpus: int) -> float:
    """Seconds per sample of a pipeline with per-sample work W (in a worker) and M (consumer)."""
    if workers == 0:
        return worker_s + consumer_s
    return max(consumer_s, worker_s / min(workers, cpus), (worker_s + consumer_s) / min(cpus, workers + 1))


def limited_by(workers: int, cpus: int, work_s: float, window_s: float, consumer_rate: float,
               loader_rate: float | None) -> str:
    """"serial" (0 workers: one process does everything), "cpu" (every usable core busy),
    "loader" (the workers produce slower than the consumer could take) or "consumer"."""
    if workers == 0:
        return "serial"
    if window_s > 0 and work_s / window_s >= SATURATED * min(cpus, workers + 1):
        return "cpu"
    return "loader" if loader_rate is not None and loader_rate < consumer_rate else "consumer"


def bottleneck(stages: list[dict[str, Any]], limit: str, wait_share: float) -> dict[str, Any]:
    """The stage to act on: the largest share of work on the slow side (either side when the
    cores are saturated or everything runs in one process)."""
    sides = {"loader": ("worker",), "consumer": ("consumer",)}.get(limit, ("worker", "consumer"))
    candidates = [s for s in stages if s["work"] and s["side"] in sides and s["count"]]
    top = max(candidates or [s for s in stages if s["work"]], key=lambda s: s["share"] or 0.0)
    why = {"loader": f"loader-bound: the workers deliver slower than the consumer could take; it waits "
                     f"{wait_share:.0%} of its time",
           "consumer": "consumer-bound: the workers deliver faster than the main process (receiving, "
                       "processor, pickling) takes samples",
           "cpu": "CPU-bound: every usable core is busy",
           "serial": "0 workers: reading, decoding and processing share one process"}[limit]
    return {"stage": top["name"], "side": top["side"], "share": top["share"] or 0.0, "limited_by": limit,
            "text": f"{top['name']} is {(top['share'] or 0.0):.0%} of pipeline work ({why})"}


# ------------------------------------------------------------------------------ scaling / Amdahl

def amdahl_serial_fraction(points: Sequence[tuple[int, float]]) -> float | None:
    """Least-squares serial fraction s of 1/speedup(w) = s + (1 - s) / w, speedups relative to
    1 worker; None without a 1-worker point and one with more workers."""
    base = dict(points).get(1)
    pairs = [(w, r) for w, r in points if w > 1 and r > 0]
    if not base or not pairs:
        return None
    num = sum((base / r - 1 / w) * (1 - 1 / w) for w, r in pairs)
    den = sum((1 - 1 / w) ** 2 for w, _ in pairs)
    return min(1.0, max(0.0, num / den))


def amdahl_speedup(serial: float, workers: int) -> float:
    return 1.0 / (serial + (1.0 - serial) / max(workers, 1))


# ----------------------------------------------------------------------------------- candidates

@dataclass
class Candidate:
    """A proposed config change, before its effect is measured."""
    rule: str
    stage: str
    key: str
    current: Any
    proposed: Any
    decode: dict[str, Any] = field(default_factory=dict)  # DecodeOptions fields for the probe
    processor: dict[str, Any] = field(default_factory=dict)  # processor kwargs for the probe
    detail: str = ""
    # stages the change can move; the probe's ratios for the others are noise and are ignored
    affects: tuple[str, ...] = ("video_decode", "processor", "serialise")


def _floor_even(n: int) -> int:
    return max(2, n - n % 2)


def _mean_frames(videos: list[dict[str, Any]], options: Any) -> float:
    """Mean frames per video that `options` samples from the measured videos."""
    from mmrl.data.video import sample_frame_indices
    counts = [len(sample_frame_indices(v["total_frames"], v["source_fps"], options)[0]) for v in videos]
    return sum(counts) / len(counts)


def video_frames_candidate(videos: list[dict[str, Any]], options: Any) -> Candidate | None:
    """Halve the frames decoded per video through whichever knob binds: num_frames when set, else
    fps, else max_frames (counts computed with the real frame sampler on the measured videos)."""
    import dataclasses
    if not videos:
        return None
    now = _mean_frames(videos, options)
    if options.num_frames is not None:
        tries = [("num_frames", options.num_frames, _floor_even(options.num_frames // 2))]
    else:
        tries = [("fps", options.fps, options.fps / 2),
                 ("max_frames", options.max_frames, _floor_even(options.max_frames // 2))]
    for name, current, proposed in tries:
        if proposed == current:
            continue
        new = _mean_frames(videos, dataclasses.replace(options, **{name: proposed}))
        if new <= 0.75 * now:
            return Candidate("video_frames", "video_decode", f"data.decode.{name}", current, proposed,
                             decode={name: proposed}, detail=f"frames per video {now:.0f}→{new:.0f}")
    return None


def video_pixels_candidate(videos: list[dict[str, Any]], options: Any) -> Candidate | None:
    """Quarter the frame size the processor gets (data.decode.max_pixels) when frames are large."""
    if not videos:
        return None
    frame_pixels = sorted(v["pixels"] for v in videos)[len(videos) // 2]
    current = options.max_pixels
    proposed = max(4 * PATCH_PIXELS, (min(current or frame_pixels, frame_pixels) // 4) // PATCH_PIXELS * PATCH_PIXELS)
    if proposed >= frame_pixels:
        return None
    return Candidate("video_pixels", "processor", "data.decode.max_pixels", current, proposed,
                     decode={"max_pixels": proposed}, detail=f"frame pixels {frame_pixels}→≤{proposed}")


def processor_pixels_candidate(image_pixels: list[int], budget: int | None, min_pixels: int | None,
                               current: int | None) -> Candidate | None:
    """Quarter the processor's image pixel budget (processor.max_pixels) when images exceed it."""
    if not image_pixels:
        return None
    median = sorted(image_pixels)[len(image_pixels) // 2]
    effective = min(budget or median, median)
    proposed = (effective // 4) // PATCH_PIXELS * PATCH_PIXELS
    if proposed < max(4 * PATCH_PIXELS, min_pixels or 0) or proposed >= effective:
        return None
    return Candidate("processor_pixels", "processor", "processor.max_pixels", current if current is not None else budget,
                     proposed, processor={"max_pixels": proposed},
                     detail=f"image pixels into the vision tower ≤{effective}→≤{proposed}",
                     affects=("processor", "serialise"))


# ---------------------------------------------------------------------------------- predictions

@dataclass
class Context:
    """What the advice is computed from (one profiled run plus its scaling sweep)."""
    stages: dict[str, dict[str, Any]]  # name -> stage row
    samples: int  # measured samples the stage totals cover
    workers: int
    cpus: int
    limit: str  # limited_by(...)
    sweep: list[tuple[int, float]]  # (workers, samples/s)

    def per_sample(self, names: Sequence[str]) -> float:
        return sum(self.stages[n]["total_s"] for n in names if n in self.stages) / max(self.samples, 1)

    def consumer_s(self) -> float:
        """Consumer work per sample. When the consumer is the slow side its time in next() is not
        waiting for workers but receiving (unpickling, copying images out of shared memory): work, too."""
        extra = ("handoff_wait",) if self.limit == "consumer" else ()
        return self.per_sample(CONSUMER_STAGES + extra)


def predict_change(ctx: Context, ratios: dict[str, float]) -> float:
    """Speedup of scaling each stage's time by ratios[stage] (new / old, from a probe)."""
    w_old, m_old = ctx.per_sample(WORKER_STAGES), ctx.consumer_s()
    w_new = w_old + sum(ctx.per_sample([s]) * (r - 1) for s, r in ratios.items() if s in WORKER_STAGES)
    m_new = m_old + sum(ctx.per_sample([s]) * (r - 1) for s, r in ratios.items() if s in CONSUMER_STAGES)
    old = model_time(w_old, m_old, ctx.workers, ctx.cpus)
    new = model_time(max(w_new, 1e-9), max(m_new, 1e-9), ctx.workers, ctx.cpus)
    return old / new if new > 0 else 1.0


def predict_workers(ctx: Context, proposed: int) -> tuple[float, str]:
    """Speedup of `proposed` workers over the current count, and where the number comes from."""
    rates = dict(ctx.sweep)
    if proposed in rates and ctx.workers in rates and rates[ctx.workers] > 0:
        return rates[proposed] / rates[ctx.workers], f"measured: {rates[ctx.workers]:.1f}→{rates[proposed]:.1f} samples/s"
    serial = amdahl_serial_fraction(ctx.sweep)
    if serial is not None and ctx.workers >= 1:
        gain = amdahl_speedup(serial, proposed) / amdahl_speedup(serial, ctx.workers)
        return gain, f"Amdahl fit to the measured scaling curve (serial fraction {serial:.2f})"
    w, m = ctx.per_sample(WORKER_STAGES), ctx.consumer_s()
    gain = model_time(w, m, ctx.workers, ctx.cpus) / model_time(w, m, proposed, ctx.cpus)
    return gain, f"cost model (W={w * 1e3:.1f} ms/sample in workers, M={m * 1e3:.1f} ms in the consumer, {ctx.cpus} cores)"


def _entry(rule: str, stage: str, key: str | None, current: Any, proposed: Any, speedup: float | None,
           basis: str, text: str) -> dict[str, Any]:
    return {"rule": rule, "stage": stage, "key": key, "current": current, "proposed": proposed,
            "predicted_speedup": speedup, "predicted_saving": (1 - 1 / speedup) if speedup else None,
            "basis": basis, "text": text}


def _fmt(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def advise(ctx: Context, candidates: list[Candidate],
           probe: Callable[[Candidate], dict[str, Any]], *, image_hint: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The advice list, best predicted speedup first. `probe(candidate)` measures a change on a few
    samples and returns {"old": {stage: s}, "new": {stage: s}, "samples": n}."""
    limit = ctx.limit
    advice: list[dict[str, Any]] = []
    for c in candidates:
        measured = probe(c)
        ratios = {s: measured["new"][s] / old for s, old in measured["old"].items()
                  if old > 0 and s in measured["new"] and s in c.affects}
        gain = predict_change(ctx, ratios)
        if gain < MIN_SPEEDUP:
            continue
        share = ctx.stages[c.stage]["share"] or 0.0
        changed = ", ".join(f"{s} {measured['old'][s] * 1e3:.1f}→{measured['new'][s] * 1e3:.1f} ms"
                            for s in ratios if abs(ratios[s] - 1) >= 0.05)
        basis = f"probe on {measured['samples']} samples ({c.detail}; {changed or 'no stage changed'}); cost model, {limit}"
        advice.append(_entry(c.rule, c.stage, c.key, c.current, c.proposed, gain, basis,
                             f"{c.stage} is {share:.0%} of pipeline work: {'lowering' if _lower(c) else 'changing'} "
                             f"{c.key} {_fmt(c.current)}→{_fmt(c.proposed)} ({c.detail}) is predicted to give "
                             f"{gain:.2f}× (saves ~{1 - 1 / gain:.0%} per sample)"))
    worker_share = sum(ctx.stages[s]["share"] or 0.0 for s in WORKER_STAGES if s in ctx.stages)
    rates = dict(ctx.sweep)
    more_workers = None
    best = max(rates, key=lambda w: rates[w]) if rates.get(ctx.workers) else ctx.workers
    if best != ctx.workers and rates[best] >= MIN_SPEEDUP * rates[ctx.workers]:  # the sweep measured a better count
        gain = rates[best] / rates[ctx.workers]
        basis = f"measured: {rates[ctx.workers]:.1f}→{rates[best]:.1f} samples/s"
        more_workers = _entry("num_workers", "loader", "data.num_workers", ctx.workers, best, gain, basis,
                              f"{'raising' if best > ctx.workers else 'lowering'} data.num_workers {ctx.workers}→{best} "
                              f"is predicted to give {gain:.2f}× ({basis})")
    elif ctx.workers < ctx.cpus and limit in ("loader", "serial") and worker_share >= 0.5:
        proposed = min(ctx.cpus, max(ctx.workers + 1, 2 * ctx.workers))
        gain, basis = predict_workers(ctx, proposed)
        if gain >= MIN_SPEEDUP and proposed not in rates:  # a measured count was handled above
            more_workers = _entry("num_workers", "loader", "data.num_workers", ctx.workers, proposed, gain, basis,
                                  f"the loader is {worker_share:.0%} of pipeline work: raising data.num_workers "
                                  f"{ctx.workers}→{proposed} is predicted to give {gain:.2f}× ({basis})")
    if more_workers:
        advice.append(more_workers)
    elif limit in ("loader", "cpu") and ctx.workers >= ctx.cpus:
        advice.append(_entry("cores", "loader", None, ctx.workers, None, None, f"{ctx.cpus} usable cores",
                             f"all {ctx.cpus} cores are in use ({ctx.workers} workers): more workers will not help; "
                             f"cut the work per sample instead"))
    elif limit == "consumer":
        more = [w for w in sorted(rates) if w > ctx.workers]
        seen = (f" (measured: {ctx.workers}→{more[0]} workers gives {rates[more[0]] / rates[ctx.workers]:.2f}×)"
                if more and rates.get(ctx.workers) else "")
        advice.append(_entry("consumer_bound", "consumer", None, ctx.workers, None, None,
                             "loader rate > consumer rate",
                             f"the main process sets the pace ({ctx.consumer_s() * 1e3:.1f} ms per sample receiving, "
                             f"processing and pickling): more loader workers will not help{seen}"))
    if image_hint:
        advice.append(image_hint)
    return sorted(advice, key=lambda a: -(a["predicted_speedup"] or 0.0))


def _lower(c: Candidate) -> bool:
    try:
        return float(c.proposed) < float(c.current)
    except (TypeError, ValueError):
        return False


def image_decode_hint(stages: dict[str, dict[str, Any]], decoded_pixels: list[int],
                      processed_pixels: list[int]) -> dict[str, Any] | None:
    """Images decoded far above the size the processor keeps: no config key fixes that, smaller
    images in the shards do (decode time grows with pixels)."""
    share = stages.get("image_decode", {}).get("share") or 0.0
    if share < MIN_SHARE or not decoded_pixels or not processed_pixels:
        return None
    dec = sorted(decoded_pixels)[len(decoded_pixels) // 2]
    kept = sorted(processed_pixels)[len(processed_pixels) // 2]
    if dec < 2 * kept:
        return None
    return _entry("image_size_hint", "image_decode", None, dec, kept, None,
                  f"median decoded {dec} px vs {kept} px kept by the processor",
                  f"image_decode is {share:.0%} of pipeline work and images are decoded at {dec / 1e6:.2f} MP "
                  f"but the processor keeps {kept / 1e6:.2f} MP: store them at that size (re-encode the "
                  f"shards) to cut decode time ~{1 - kept / dec:.0%}")
