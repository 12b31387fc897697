"""Every benchmark in its quick version, one after the other: does each still run end to end?

    .venv/bin/python benchmarks/quick.py [--out runs/bench-quick] [--only NAME ...]     (make bench)

Each script runs with small sizes (a few steps, few samples, one repeat) and writes to --out,
never over the committed results in benchmarks/results/. The quick numbers are not the
benchmarks' figures (too short to mean much on a noisy machine); the full commands in
benchmarks/README.md make those. Prints one line per benchmark: ok or its exit code, and seconds;
exits non-zero if any failed.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# script -> its quick arguments; {out} is the output folder
QUICK: dict[str, list[str]] = {
    "data_pipeline.py": ["--images", "128", "--videos", "8", "--repeats", "1", "--out", "{out}/data_pipeline.json"],
    "profiler_overhead.py": ["--samples", "256", "--repeats", "2", "--out", "{out}/profiler_overhead.json"],
    "profile_advice.py": ["--repeats", "1", "--out", "{out}/profile_advice.json"],
    "algorithms.py": ["--only", "grpo", "dapo", "--max-steps", "5", "--out", "{out}"],
    "colors_learning.py": ["--seeds", "0", "--budget-s", "60", "--out", "{out}"],
    "long_run.py": ["--steps", "5", "--out", "{out}"],
    "staleness.py": ["--ks", "1", "--budget-s", "45", "--out", "{out}"],
    "async_vs_sync.py": ["--steps", "3", "--modes", "sync", "async_k1", "--out", "{out}"],
    "tool_tasks.py": ["--max-steps", "3", "--out", "{out}"],
    "turn_probe.py": ["--task", "gui_click", "--steps", "10", "--eval-every", "5", "--out", "{out}/turn_probe.json"],
    "task_probe.py": ["--data", "work/data/colors", "--steps", "10", "--eval-every", "5", "--max-train", "64",
                      "--out", "{out}/task_probe.json"],
    "tasks.py": ["--tasks", "multi_image", "--seeds", "0", "--max-steps", "3", "--out", "{out}"],
    "video_probe.py": ["--steps", "20", "--eval-every", "10", "--conditions", "main", "--out", "{out}/video_probe.json"],
    "moe_stability.py": ["--only", "off", "r3", "--max-steps", "3", "--eval-every", "2", "--out", "{out}"],
    "weight_sync.py": ["--steps", "3", "--world-sizes", "1", "--out", "{out}"],
    "rollout.py": ["--prompts", "4", "--repeats", "1", "--out", "{out}"],
    "startup.py": ["--rounds", "1", "--out", "{out}"],
    "trainer_bound.py": ["--hidden-size", "128", "--num-layers", "2", "--prompts", "2", "--group", "4",
                         "--max-new", "16", "--rounds", "1", "--out", "{out}"],
    "vs_trl.py": ["--regimes", "demo", "--max-steps", "5", "--out", "{out}"],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(REPO / "runs" / "bench-quick"))
    ap.add_argument("--only", nargs="+", choices=sorted(QUICK), help="these benchmarks only")
    args = ap.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    failed = []
    for script in args.only or list(QUICK):
        cmd = [sys.executable, str(REPO / "benchmarks" / script), *(a.format(out=out) for a in QUICK[script])]
        log = out / f"{Path(script).stem}.log"
        t0 = time.time()
        with open(log, "w") as f:
            rc = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT).returncode
        print(f"{script:22s} {'ok' if rc == 0 else f'exit {rc} (see {log})':40s} {time.time() - t0:7.0f} s", flush=True)
        if rc:
            failed.append(script)
    if failed:
        raise SystemExit(f"failed: {', '.join(failed)}")


if __name__ == "__main__":
    main()
