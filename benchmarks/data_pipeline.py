"""Loader throughput vs the decode-only bound, for image sets and a video set, in one run.

    .venv/bin/python benchmarks/data_pipeline.py [--workers 2] [--images 1024] [--videos 96]

The bound (mmrl.profiling.decode_bound, also used by `mmrl profile-data`): the same decoders
(mmrl.data.decode.decode_sample) on the same number of worker processes, fed raw sample bytes
already in memory: no tar reading, no shuffle buffer, no queue
between processes beyond handing back a count. The loader: ShardStream over the tar shards with
`--workers` DataLoader workers, one epoch, everything delivered to the main process as Samples.
Ratio = loader samples/s / bound samples/s (goal >= 0.9). Results go to
benchmarks/results/data_pipeline.json.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def decode_bound(pattern: list[str], workers: int) -> float:
    """Samples/s of decode alone on `workers` processes (raw bytes pre-loaded and pre-split);
    the logic lives in mmrl.profiling.decode_bound, shared with `mmrl profile-data`."""
    from mmrl.profiling.decode_bound import decode_bound as bound, read_raw_samples

    return bound(read_raw_samples(pattern), workers)


def loader_rate(pattern: list[str], workers: int) -> float:
    from mmrl.data.stream import ShardStream

    stream = ShardStream(pattern, num_workers=workers, epochs=1, shuffle_buffer=0, max_bad_ratio=None)
    it = iter(stream)
    first = next(it)  # worker start-up is not throughput
    t0 = time.perf_counter()
    n = sum(1 for _ in it)
    rate = n / (time.perf_counter() - t0)
    stream.close()
    assert first is not None and n > 0
    return rate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--images", type=int, default=2048)
    ap.add_argument("--image-sizes", type=int, nargs="+", default=[224, 448],
                    help="one image set per size: the per-sample pipeline cost is fixed, decode grows with pixels")
    ap.add_argument("--videos", type=int, default=128)
    ap.add_argument("--frames", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "data_pipeline.json"))
    args = ap.parse_args()
    from mmrl import registry
    from mmrl.utils.paths import repo_relative

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        sets = []
        for size in args.image_sizes:
            registry.resolve("dataset", "colors")(f"{tmp}/img{size}", train_size=args.images, heldout_size=8,
                                                  image_size=size, shard_size=256, image_format="jpg")
            sets.append((f"image {size}x{size} jpg", f"img{size}"))
        registry.resolve("dataset", "video_motion")(f"{tmp}/vid", train_size=args.videos, heldout_size=4,
                                                    frames=args.frames, width=224, height=224, shard_size=32)
        sets.append((f"video {args.frames}f 224x224 mp4", "vid"))
        for name, folder in sets:
            spec = sorted(str(p) for p in Path(tmp, folder).glob("train-*.tar"))
            bounds, loads = [], []
            for _ in range(args.repeats):  # interleaved, so drift on a noisy machine hits both
                bounds.append(decode_bound(spec, args.workers))
                loads.append(loader_rate(spec, args.workers))
            bound, load = max(bounds), max(loads)
            results[name] = {"decode_bound_samples_per_s": bound, "loader_samples_per_s": load,
                             "ratio": load / bound, "all_bound": bounds, "all_loader": loads}
            print(f"{name:22s}: loader {load:8.1f} samples/s | decode-only bound {bound:8.1f} samples/s | "
                  f"ratio {load / bound:.2f}  ({args.workers} workers, best of {args.repeats})", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    # the output path relative to the checkout: committed results must not name the machine
    recorded = {**vars(args), "out": repo_relative(args.out, REPO)}
    out.write_text(json.dumps({"args": recorded, "results": results}, indent=1))


if __name__ == "__main__":
    main()
