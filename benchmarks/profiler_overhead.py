"""What the profiler's instrumentation costs: loader throughput with ShardStream(profile=True) vs
profile=False, side by side in one run.

    .venv/bin/python benchmarks/profiler_overhead.py [--workers 0 1] [--samples 2048] [--repeats 7]

The data set is the worst case for relative overhead: small 56x56 PNG samples (colors recipe), so
the per-sample work the timers are measured against is a fraction of a millisecond. Each repeat
runs one epoch with instrumentation off and one with it on, back to back, alternating which goes
first (so drift on a noisy machine hits both); the consumer drains `profile_records` as
`mmrl profile-data` does. Reported per worker count:
  wall  on / off loader samples/s, best of --repeats each (the runs least disturbed by other
        processes), and the median of the per-pair ratios;
  CPU   on / off samples per CPU-second of this process and its workers (best of each): what
        the timers cost in work, which other load on the machine moves less than wall time.
Goal: overhead = 1 - ratio under 3%. Results: benchmarks/results/profiler_overhead.json.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _cpu_seconds() -> float:
    """CPU seconds of this process and of its finished children (the DataLoader workers)."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def loader_run(pattern: str, workers: int, profile: bool) -> tuple[float, float]:
    """One epoch through ShardStream: (samples/s from the first sample on, i.e. start-up excluded;
    samples per CPU second, start-up included, workers counted once they have exited)."""
    from mmrl.data.stream import ShardStream

    cpu0 = _cpu_seconds()
    stream = ShardStream(pattern, num_workers=workers, epochs=1, shuffle_buffer=0, max_bad_ratio=None,
                         profile=profile)
    it = iter(stream)
    next(it)
    start = time.perf_counter()
    n = 0
    for _ in it:  # to the end of the epoch: the workers are joined when the loop ends
        n += 1
        if profile:
            stream.profile_records.clear()  # what the profiler's consumer does with them
    wall = time.perf_counter() - start
    return n / wall, (n + 1) / (_cpu_seconds() - cpu0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--samples", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "profiler_overhead.json"))
    args = ap.parse_args()
    from mmrl.plugins.data.recipes.colors import build
    from mmrl.utils.paths import repo_relative

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        info = build(tmp, train_size=args.samples, heldout_size=8, shard_size=max(args.samples // 4, 1), seed=0)
        pattern = str(Path(tmp) / info["shards"]["train"])
        for workers in args.workers:
            loader_run(pattern, workers, True)  # warm the page cache and imports
            runs: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
            for r in range(args.repeats):
                for profile in ((True, False) if r % 2 else (False, True)):
                    runs[profile].append(loader_run(pattern, workers, profile))
            on, off = [w for w, _ in runs[True]], [w for w, _ in runs[False]]
            cpu_on, cpu_off = [c for _, c in runs[True]], [c for _, c in runs[False]]
            best = max(on) / max(off)
            cpu = max(cpu_on) / max(cpu_off)
            pairs = [a / b for a, b in zip(on, off)]
            results[f"workers={workers}"] = {
                "off_samples_per_s": off, "on_samples_per_s": on, "best_ratio": best,
                "median_pair_ratio": statistics.median(pairs),
                "off_samples_per_cpu_s": cpu_off, "on_samples_per_cpu_s": cpu_on, "cpu_ratio": cpu,
                "overhead": 1 - best, "cpu_overhead": 1 - cpu}
            print(f"{workers} worker(s): samples/s off {max(off):7.1f} on {max(on):7.1f} (best of {args.repeats}): "
                  f"on/off {best:.3f} (median of pairs {statistics.median(pairs):.3f}) | samples per CPU-second "
                  f"off {max(cpu_off):7.1f} on {max(cpu_on):7.1f} (best): on/off "
                  f"{cpu:.3f} | overhead {1 - best:+.1%} wall, {1 - cpu:+.1%} CPU", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # the output path relative to the checkout: committed results must not name the machine
    recorded = {**vars(args), "out": repo_relative(args.out, REPO)}
    out.write_text(json.dumps({"args": recorded, "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
