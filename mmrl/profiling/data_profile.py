"""`mmrl profile-data`: the config's data path alone (no training, no vLLM, no Ray), every stage timed.

    report = profile_data("configs/colors_demo.yaml", ["data.num_workers=2"], samples=256, workers=[1, 2])

Steps: one measured pipeline run per worker count of the sweep (mmrl.profiling.pipeline); the
stage breakdown of the run at cfg.data.num_workers; the decode-only bound at that worker count
(mmrl.profiling.decode_bound); the bottleneck and advice, each proposed change measured by a probe
(mmrl.profiling.advice, mmrl.profiling.probes); then report.json / report.md / trace.json /
chart.png (mmrl.profiling.output). docs/profiling.md explains the fields.
"""
from __future__ import annotations

import datetime
import os
import platform
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from mmrl.profiling import advice as adv
from mmrl.profiling.pipeline import PipelineRun, build_config_processor, decode_options, run_pipeline
from mmrl.profiling.stats import fill_shares, stage_stats

SCHEMA_VERSION = 1
SCALING_DEFINITION = ("efficiency(w) = samples/s at w workers / (max(w, 1) x samples/s at the baseline); "
                      "the baseline is 1 worker, or 0 workers when 1 was not measured (both read one stream)")
BOUND_DEFINITION = ("the same decoders on the same number of processes with no pipeline (raw bytes in memory, "
                    "no tar reading, no queue); pipeline_efficiency = end-to-end samples/s / bound samples/s")


BOUND_MAX_BYTES = 512 * 2**20  # raw bytes held in memory for the decode-only bound


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def default_sweep(num_workers: int, cpus: int) -> list[int]:
    """1 worker (the scaling baseline), the configured count, and twice it within the cores."""
    return sorted({1, num_workers, max(1, min(2 * max(num_workers, 1), cpus))})


def stage_breakdown(run: PipelineRun) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """report["stages"] and report["decoders"] of one run."""
    recs = [s.worker for s in run.samples if s.worker]
    images = [i for r in recs for i in r.get("images", [])]
    videos = [v for r in recs for v in r.get("videos", [])]
    parse = [r.get("read_s", 0.0) - r.get("io_s", 0.0) - r.get("open_s", 0.0) for r in recs]
    read_bytes = sum(r.get("bytes", 0) for r in recs)
    checks = [r["decode_s"] - sum(i["s"] for i in r.get("images", [])) - sum(v["s"] for v in r.get("videos", []))
              for r in recs if "decode_s" in r]
    latency = [s.worker["delivered"] - s.ready for s in run.samples if s.ready is not None and "delivered" in s.worker]
    done = [s for s in run.samples if not s.rejected]
    stages = [
        stage_stats("shard_open", "worker", [r["open_s"] for r in recs if "open_s" in r]),
        stage_stats("shard_read", "worker", [r.get("io_s", 0.0) for r in recs], nbytes=read_bytes),
        stage_stats("tar_parse", "worker", [max(p, 0.0) for p in parse], nbytes=read_bytes),
        stage_stats("sample_parse", "worker", [max(c, 0.0) for c in checks]),
        stage_stats("image_decode", "worker", [i["s"] for i in images], nbytes=sum(i["bytes"] for i in images)),
        stage_stats("video_decode", "worker", [v["s"] for v in videos], nbytes=sum(v["bytes"] for v in videos)),
        stage_stats("handoff_latency", "handoff", latency, work=False),
        stage_stats("handoff_wait", "handoff", [s.wait_s for s in run.samples], work=False),
        stage_stats("processor", "consumer", [s.processor_s for s in run.samples]),
        stage_stats("serialise", "consumer", [s.serialise_s for s in done],
                    nbytes=sum(s.serialise_bytes for s in done)),
    ]
    fill_shares(stages)
    decoders: dict[str, dict[str, Any]] = {}
    for v in videos:
        d = decoders.setdefault(v["backend"], {"backend": v["backend"], "videos": 0, "frames": 0, "total_s": 0.0})
        d["videos"] += 1
        d["frames"] += v["frames"]
        d["total_s"] += v["s"]
    for d in decoders.values():
        d["mean_ms"] = d["total_s"] / d["videos"] * 1e3
        d["frames_per_s"] = d["frames"] / d["total_s"] if d["total_s"] > 0 else None
    return stages, sorted(decoders.values(), key=lambda d: -d["videos"])


def _scaling(runs: dict[int, PipelineRun]) -> dict[str, Any]:
    base_w = 1 if 1 in runs else (0 if 0 in runs else None)
    base = runs[base_w].samples_per_s if base_w is not None else None
    points = []
    for w, run in sorted(runs.items()):
        rate = run.samples_per_s
        points.append({"workers": w, "samples_per_s": rate, "consumer_samples_per_s": run.consumer_rate,
                       "loader_samples_per_s": run.loader_rate, "wait_share": run.wait_share,
                       "startup_s": run.startup_s,
                       "speedup": rate / base if base else None,
                       "efficiency": rate / (max(w, 1) * base) if base else None})
    serial = adv.amdahl_serial_fraction([(w, r.samples_per_s) for w, r in runs.items()])
    return {"baseline_workers": base_w, "definition": SCALING_DEFINITION, "points": points,
            "amdahl_serial_fraction": serial}


def _processor_budget(processor: Any) -> int | None:
    """The image pixel budget the processor applies (processor.max_pixels or the model's default)."""
    ip = getattr(getattr(processor, "hf", None), "image_processor", None)
    size = getattr(ip, "size", None)
    value = size.get("longest_edge") if isinstance(size, dict) else getattr(size, "longest_edge", None)
    return int(value) if value else getattr(ip, "max_pixels", None)


def _kept_pixels(processor: Any, sample: Any) -> list[int]:
    """Pixels per image the processor keeps for a sample (its image grid x patch area)."""
    import numpy as np
    try:
        enc = processor(sample).mm_inputs.get("image_grid_thw")
    except Exception:
        return []
    patch = int(getattr(processor.hf.image_processor, "patch_size", 14))
    return [] if enc is None else [int(np.prod(row.tolist())) * patch * patch for row in enc]


def _advice(cfg: Any, run: PipelineRun, stages: list[dict[str, Any]], runs: dict[int, PipelineRun],
            processor: Any, limit: str, cpus: int, probe_samples: int,
            say: Callable[[str], None]) -> list[dict[str, Any]]:
    from mmrl.profiling.decode_bound import read_raw_samples
    from mmrl.profiling.probes import probe

    by_name = {s["name"]: s for s in stages}
    recs = [s.worker for s in run.samples if s.worker]
    videos = [v for r in recs for v in r.get("videos", [])]
    image_px = [i["pixels"] for r in recs for i in r.get("images", [])]
    options = decode_options(cfg, processor)
    share = lambda *names: sum(by_name[n]["share"] or 0.0 for n in names)  # noqa: E731
    candidates = []
    if share("video_decode") >= adv.MIN_SHARE:
        candidates.append(adv.video_frames_candidate(videos, options))
    if share("processor", "serialise") >= adv.MIN_SHARE:
        candidates.append(adv.video_pixels_candidate(videos, options))
        candidates.append(adv.processor_pixels_candidate(image_px, cfg.processor.max_pixels or _processor_budget(processor),
                                                         cfg.processor.min_pixels, cfg.processor.max_pixels))
    candidates = [c for c in candidates if c is not None]
    raws = read_raw_samples(cfg.data.train_shards, limit=probe_samples) if candidates else []

    def measure(c: adv.Candidate) -> dict[str, Any]:
        say(f"probe: {c.key} {c.current} -> {c.proposed} on {len(raws)} samples")
        new_proc = build_config_processor(cfg, **c.processor) if c.processor else None
        return probe(raws, options, processor, decode_changes=c.decode, new_processor=new_proc)

    ctx = adv.Context(by_name, len(run.samples), run.workers, cpus, limit,
                      [(w, r.samples_per_s) for w, r in runs.items()])
    hint = None
    if share("image_decode") >= adv.MIN_SHARE:
        kept = [px for s in run.kept for px in _kept_pixels(processor, s)]
        hint = adv.image_decode_hint(by_name, image_px, kept)
    return adv.advise(ctx, candidates, measure, image_hint=hint)


def profile_data(config: str, overrides: Sequence[str] = (), *, samples: int = 256,
                 workers: Sequence[int] | None = None, out_dir: str | os.PathLike | None = None,
                 probe_samples: int = 8, bound: bool = True,
                 say: Callable[[str], None] = lambda m: None) -> dict[str, Any]:
    """Profile the data path of `config` (+ overrides); write the outputs into out_dir (default
    profiles/<run.name>); return the report (report.schema.json)."""
    from mmrl.config import load_config
    from mmrl.profiling import output

    if samples < 2:
        raise ValueError(f"--samples must be >= 2, got {samples}")
    cfg = load_config(config, list(overrides))
    cpus = usable_cpus()
    primary = cfg.data.num_workers
    sweep = sorted(set(workers if workers is not None else default_sweep(primary, cpus)) | {primary})
    if any(w < 0 for w in sweep):
        raise ValueError(f"--workers must be >= 0, got {sweep}")
    out = Path(out_dir) if out_dir is not None else Path("profiles") / cfg.run.name
    processor = build_config_processor(cfg)
    runs: dict[int, PipelineRun] = {}
    for w in sweep:
        say(f"pipeline: {w} worker(s), {samples} samples")
        runs[w] = run_pipeline(cfg, processor, w, samples, keep=probe_samples if w == primary else 0)
    run = runs[primary]
    stages, decoders = stage_breakdown(run)
    work = sum(s["total_s"] for s in stages if s["work"])
    per_sample = lambda names: sum(s["total_s"] for s in stages if s["name"] in names) / len(run.samples)  # noqa: E731
    end_to_end = {"samples_per_s": run.samples_per_s, "consumer_samples_per_s": run.consumer_rate,
                  "loader_samples_per_s": run.loader_rate, "window_s": run.window_s, "startup_s": run.startup_s,
                  "wait_share": run.wait_share, "busy_cores": work / run.window_s if run.window_s > 0 else 0.0,
                  "worker_ms_per_sample": per_sample(adv.WORKER_STAGES) * 1e3,
                  "consumer_ms_per_sample": per_sample(adv.CONSUMER_STAGES) * 1e3}
    decode_bound_out = None
    if bound:
        from mmrl.profiling.decode_bound import decode_bound, read_raw_samples
        say(f"decode-only bound: {primary} worker(s)")
        raws = read_raw_samples(cfg.data.train_shards, limit=samples + run.warmup, max_bytes=BOUND_MAX_BYTES)
        rate = decode_bound(raws, primary, decode_options(cfg, processor))
        decode_bound_out = {"workers": primary, "samples": len(raws), "samples_per_s": rate,
                            "pipeline_efficiency": run.samples_per_s / rate if rate > 0 else None,
                            "definition": BOUND_DEFINITION}
        del raws
    limit = adv.limited_by(primary, cpus, work, run.window_s, run.consumer_rate, run.loader_rate)
    neck = adv.bottleneck(stages, limit, run.wait_share)
    advice = _advice(cfg, run, stages, runs, processor, limit, cpus, probe_samples, say)
    recs = [s.worker for s in run.samples if s.worker]
    report = {
        "schema_version": SCHEMA_VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "config": {"path": str(config), "name": cfg.run.name, "overrides": list(overrides),
                   "model_path": cfg.model.path, "train_shards": cfg.data.train_shards,
                   "num_workers": primary, "shuffle_buffer": cfg.data.shuffle_buffer,
                   "decode": {**vars(cfg.data.decode), "decoders": list(cfg.data.decode.decoders)},
                   "processor": {"name": cfg.processor.name, "min_pixels": cfg.processor.min_pixels,
                                 "max_pixels": cfg.processor.max_pixels,
                                 "max_prompt_tokens": cfg.processor.max_prompt_tokens}},
        "machine": {"cpus": cpus, "platform": platform.platform(), "python": sys.version.split()[0]},
        "samples": {"measured": len(run.samples), "warmup": run.warmup, "bad": run.bad,
                    "rejected": sum(s.rejected for s in run.samples),
                    "images": sum(len(r.get("images", [])) for r in recs),
                    "videos": sum(len(r.get("videos", [])) for r in recs),
                    "mean_tokens": sum(s.tokens for s in run.samples) / len(run.samples)},
        "workers": primary,
        "stages": stages,
        "decoders": decoders,
        "end_to_end": end_to_end,
        "scaling": _scaling(runs),
        "decode_bound": decode_bound_out,
        "bottleneck": neck,
        "advice": advice,
        "outputs": {},
    }
    output.write_all(report, run, out)
    return report
