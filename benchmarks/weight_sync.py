"""How long does a weight sync take, against a plain memory copy of the same bytes?

    .venv/bin/python benchmarks/weight_sync.py [--hidden-size 1024] [--num-layers 6] [--steps 6] \
        [--world-sizes 1 2] [--bucket-mb 64] [--transports object_store collective]

Builds a random Qwen2.5-VL of ~50 M parameters with the tiny-model kit (`work/bench-vlm-<h>x<l>`,
once), then runs the real `mmrl train configs/colors_demo.yaml` on it for a few steps per trainer
world size (vLLM engine in Ray, DeepSpeed ZeRO-3, the in-place sync after every step; short
answers, no eval or checkpoints, so the steps are mostly sync). Each step logs
`time/weight_sync_s` (gather ZeRO-3 shards bucket by bucket, serialise, send through Ray's object
store, the engine's load) and `weight_sync/apply_s` (the engine's load alone). The baseline is
measured in this process in the same run: `dst.copy_(src)` of a buffer of the same bytes, the
median of 20 copies. Prints the medians (the first step is left out: it pays one-off costs) and
the ratios, and writes benchmarks/results/weight_sync.json. Goal (issue 15): sync <= 3x the copy.
With several `--transports` (weight_sync.transport) each is run and reported side by side, with
`weight_sync/engine_peak_staged_mb` (the most an engine held staged at once).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def ensure_model(hidden_size: int, num_layers: int) -> tuple[Path, int]:
    """The benchmark model folder and its parameter count."""
    from safetensors import safe_open

    from mmrl.models.tiny_vlm import build_tiny_vlm

    path = REPO / "work" / f"bench-vlm-{hidden_size}x{num_layers}"
    if not (path / "config.json").exists():
        build_tiny_vlm("qwen2_5_vl", path, hidden_size=hidden_size, num_layers=num_layers)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        n = sum(_numel(f.get_slice(k).get_shape()) for k in f.keys())
    return path, n


def _numel(shape: list[int]) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def ensure_data() -> Path:
    data = REPO / "work" / "data" / "colors"
    if not (data / "dataset.json").exists():
        subprocess.run([sys.executable, "-m", "mmrl.cli", "data", "build", "colors", "--out", str(data)],
                       cwd=REPO, check=True)
    return data


def copy_seconds(nbytes: int, repeats: int = 20) -> float:
    """Median seconds of one plain memory copy of `nbytes` (float32 buffers, both already touched)."""
    import torch

    src = torch.rand(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def train(model: Path, data: Path, world_size: int, steps: int, bucket_mb: float, out: Path,
          transport: str = "object_store") -> list[dict]:
    run_dir = out / f"ws{world_size}-{transport}"
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "mmrl.cli", "train", str(REPO / "configs" / "colors_demo.yaml"),
           f"model.path={model}", f"data.train_shards={data}/train-{{000000..000003}}.tar",
           f"data.heldout_shards={data}/heldout-000000.tar", f"run.output_dir={run_dir}",
           f"run.max_steps={steps}", "run.time_limit_s=1800", f"trainer.world_size={world_size}",
           "rollout.prompts_per_step=2", "rollout.group_size=2", "eval.every_steps=0",
           "checkpoint.every_steps=0", "stability.enabled=false", f"weight_sync.bucket_mb={bucket_mb}",
           f"weight_sync.transport={transport}",
           "logging.progress_bar=false", "logging.tensorboard=false"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if proc.returncode != 0:
        raise SystemExit(f"world size {world_size}: mmrl train failed\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["step"] > 0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden-size", type=int, default=1024)
    ap.add_argument("--num-layers", type=int, default=6)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--bucket-mb", type=float, default=64.0)
    ap.add_argument("--transports", nargs="+", default=["object_store"], choices=["object_store", "collective"])
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = ap.parse_args()
    model, params = ensure_model(args.hidden_size, args.num_layers)
    data = ensure_data()
    out = Path(args.out)
    runs = out / "runs" / "weight_sync"
    runs.mkdir(parents=True, exist_ok=True)
    print(f"model: {model.relative_to(REPO)}, {params / 1e6:.1f} M parameters")
    results = []
    for transport in args.transports:
        for ws in args.world_sizes:
            steps = train(model, data, ws, args.steps, args.bucket_mb, runs, transport)[1:]  # step 1: one-off costs
            mb = steps[-1]["weight_sync/mb"]
            copy_s = copy_seconds(int(mb * 2**20))  # measured right after the run, in the same process
            sync_s = statistics.median(r["time/weight_sync_s"] for r in steps)
            apply_s = statistics.median(r["weight_sync/apply_s"] for r in steps)
            staged = max(r.get("weight_sync/engine_peak_staged_mb", float("nan")) for r in steps)
            # rank 0's parts of the sync (trainer/worker.py::sync_weights), medians; the rest of
            # time/weight_sync_s is the driver's call into the ranks
            parts = {p: statistics.median(r[f"weight_sync/{p}"] for r in steps)
                     for p in ("gather_s", "copy_s", "send_s", "finish_s") if f"weight_sync/{p}" in steps[-1]}
            row = {"transport": transport, "world_size": ws, "mb": mb, "buckets": steps[-1]["weight_sync/buckets"],
                   "steps": len(steps), "sync_s": sync_s, "apply_s": apply_s, "gather_send_s": sync_s - apply_s,
                   "copy_s": copy_s, "sync_over_copy": sync_s / copy_s, "apply_over_copy": apply_s / copy_s,
                   "engine_peak_staged_mb": staged, "parts": parts,
                   "parts_over_copy": {p: v / copy_s for p, v in parts.items()}}
            results.append(row)
            print(f"{transport}, world size {ws}: {mb:.0f} MB in {row['buckets']:.0f} buckets; sync {sync_s:.3f} s "
                  f"(engine paused/loading {apply_s:.3f} s); engine staged at most {staged:.1f} MB; "
                  f"plain copy {copy_s * 1e3:.1f} ms; sync / copy = {row['sync_over_copy']:.0f}x "
                  f"(goal <= 3x)", flush=True)
            print("   parts (x the copy): " + ", ".join(f"{p} {v:.3f} s ({v / copy_s:.1f}x)" for p, v in parts.items())
                  + f"; of finish, the engines' load {apply_s:.3f} s ({apply_s / copy_s:.1f}x)", flush=True)
    (out / "weight_sync.json").write_text(json.dumps(
        {"model": str(model.relative_to(REPO)), "parameters": params, "bucket_mb": args.bucket_mb,
         "command": "benchmarks/weight_sync.py " + " ".join(sys.argv[1:]),
         "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                  text=True).stdout.strip(), "results": results}, indent=1))


if __name__ == "__main__":
    main()
