"""One measured pass of the training data path: ShardStream -> processor -> pickle, as `mmrl train`
runs it (minus rollout and training), with per-sample stage timings.

The consumer loop is the trainer's: take the next Sample from the stream (the hand-off: how long
the consumer waits), run the real processor on it, and pickle the ProcessedPrompt the way it
crosses to the rollout and trainer processes (serialise). The loader workers time their own
stages (shard open/read, tar parsing, image and video decode) through ShardStream(profile=True).
All clocks are time.perf_counter(), which on Linux is one system-wide monotonic clock, so worker
and consumer spans line up on one time axis.

Throughput (samples/s) is measured two ways and the smaller is reported, because DataLoader
workers prefetch whole chunks (16 items) ahead:
  consumer rate  measured samples / consumer wall time: exact when the consumer is the slow side
                 (it never waits), an overestimate when the loader is (items buffered during the
                 warm-up are handed out instantly);
  loader rate    sum over workers of (items - 1) / (last - first decode end): exact when the loader
                 is the slow side (workers never block), an overestimate otherwise.
"""
from __future__ import annotations

import pickle
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from mmrl.data.decode import DecodeOptions
from mmrl.data.sample import Sample


@dataclass
class SampleTiming:
    """Everything measured about one delivered sample (worker record + consumer side)."""
    key: str
    worker: dict[str, Any]  # the loader worker's record (mmrl.data.stream, profile=True)
    wait_start: float
    wait_s: float
    processor_s: float = 0.0
    serialise_s: float = 0.0
    serialise_bytes: int = 0
    tokens: int = 0
    rejected: bool = False

    @property
    def ready(self) -> float | None:
        """When the worker finished decoding this sample."""
        w = self.worker
        return w["decode_start"] + w["decode_s"] if "decode_start" in w else None


@dataclass
class PipelineRun:
    workers: int
    warmup: int
    samples: list[SampleTiming]  # measured samples (after the warm-up)
    startup_s: float  # from creating the stream to the first sample
    window_s: float  # consumer wall time of the measured samples
    consumer_rate: float
    loader_rate: float | None  # None with 0 workers (the loader runs inside the consumer)
    bad: dict[str, int] = field(default_factory=dict)
    kept: list[Sample] = field(default_factory=list)  # a few samples for the what-if probes

    @property
    def samples_per_s(self) -> float:
        if self.loader_rate is None:
            return self.consumer_rate
        return min(self.consumer_rate, self.loader_rate)

    @property
    def wait_share(self) -> float:
        """Fraction of the consumer's time spent waiting for the loader."""
        return sum(s.wait_s for s in self.samples) / self.window_s if self.window_s > 0 else 0.0


def decode_options(cfg: Any, processor: Any = None) -> DecodeOptions:
    """The DecodeOptions `mmrl train` builds from cfg.data.decode (with the processor's media limits)."""
    return DecodeOptions.from_config(cfg.data.decode, getattr(processor, "media_limits", None))


def build_config_processor(cfg: Any, **changes: Any) -> Any:
    """The processor exactly as the trainer builds it (cfg.processor, cfg.model), with `changes`
    (e.g. max_pixels=...) applied for a what-if probe."""
    from mmrl.processors import build_processor

    kwargs = {"min_pixels": cfg.processor.min_pixels, "max_pixels": cfg.processor.max_pixels,
              "max_prompt_tokens": cfg.processor.max_prompt_tokens,
              "trust_remote_code": cfg.model.trust_remote_code}
    kwargs.update(changes)
    return build_processor(cfg.processor.name, cfg.model.path, **kwargs)


def _loader_rate(samples: list[SampleTiming]) -> float | None:
    by_worker: dict[int, list[float]] = {}
    for s in samples:
        if s.ready is not None:
            by_worker.setdefault(int(s.worker.get("worker", 0)), []).append(s.ready)
    rates = []
    for times in by_worker.values():
        times.sort()
        if len(times) < 2 or times[-1] <= times[0]:
            return None
        rates.append((len(times) - 1) / (times[-1] - times[0]))
    return sum(rates) if rates else None


def run_pipeline(cfg: Any, processor: Any, workers: int, num_samples: int, *,
                 keep: int = 0) -> PipelineRun:
    """Stream `num_samples` measured samples (after one warm-up sample per worker) through the
    config's loader with `workers` DataLoader workers, the processor and pickle."""
    from mmrl.data.stream import ShardStream

    warmup = max(1, workers)  # each worker's first sample pays imports and first-call costs
    stream = ShardStream(cfg.data.train_shards, shuffle_buffer=cfg.data.shuffle_buffer, seed=cfg.run.seed,
                         num_workers=workers, decode=decode_options(cfg, processor), max_bad_ratio=None, profile=True)
    measured: list[SampleTiming] = []
    kept: list[Sample] = []
    created = time.perf_counter()
    startup = window_start = 0.0
    it = iter(stream)
    try:
        for i in range(warmup + num_samples):
            if i == warmup:
                window_start = time.perf_counter()
            t0 = time.perf_counter()
            sample = next(it)
            t1 = time.perf_counter()
            if i == 0:
                startup = t1 - created
            records = stream.profile_records
            worker = records[-1] if records and records[-1].get("key") == sample.key else {}
            records.clear()
            timing = SampleTiming(sample.key, worker, t0, t1 - t0)
            try:
                prompt = processor(sample)
            except Exception:  # refused (PromptRejected) or failed: what training would quarantine
                timing.rejected = True
            t2 = time.perf_counter()
            timing.processor_s = t2 - t1
            if not timing.rejected:
                blob = pickle.dumps(prompt, protocol=pickle.HIGHEST_PROTOCOL)
                timing.serialise_s = time.perf_counter() - t2
                timing.serialise_bytes = len(blob)
                timing.tokens = prompt.num_tokens
            if i >= warmup:
                measured.append(timing)
                if len(kept) < keep:
                    kept.append(sample)
        window = time.perf_counter() - window_start
    finally:
        it.close()  # stops the DataLoader workers now
    return PipelineRun(workers=workers, warmup=warmup, samples=measured, startup_s=startup, window_s=window,
                       consumer_rate=len(measured) / window if window > 0 else 0.0,
                       loader_rate=_loader_rate(measured) if workers > 0 else None,
                       bad=dict(Counter(stream.bad_counts)), kept=kept)
