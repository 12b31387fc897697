"""Seconds from `mmrl train` to the end of its first step, phase by phase.

    .venv/bin/python benchmarks/startup.py [--config configs/colors_demo.yaml] [--rounds 3] \
        [--baseline REV]

Runs `mmrl train CONFIG run.max_steps=1` `--rounds` times and reads the
`startup/<phase>_s` metrics the first step logs (imports, ray, processor, workers_started,
engines_and_ranks, rollout_workers_ready, data, first_eval, first_step; from the process start).
With `--baseline REV`, the same command from a git worktree of REV (this venv, REV's code) runs in
alternate rounds, so a start-up change is measured side by side; the ratio is baseline / current.
Besides the wall time, each run's `startup_cpu/<kind>_s` (CPU seconds per kind of process: on a
small machine the start is mostly CPU-bound, and CPU seconds move less with the machine's load
than wall seconds) and, where logged, `startup_ready/<kind>_s` (when the engines and the trainer
ranks, started side by side, were up). Prints medians and writes benchmarks/results/startup.json.
Goal (issue 15): <= 15 s for the demo on this machine.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
from _plots import write_result  # noqa: E402

sys.path.insert(0, str(REPO))
from mmrl.controller.report import startup_phases  # noqa: E402


def worktree(rev: str) -> Path:
    """A checkout of `rev` beside the runs (made once per rev), sharing this repo's `work/` assets."""
    sha = subprocess.run(["git", "rev-parse", "--short", rev], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout.strip()
    path = REPO / "runs" / "startup-baseline" / sha
    if not (path / "mmrl").exists():
        shutil.rmtree(path, ignore_errors=True)
        subprocess.run(["git", "worktree", "add", "--detach", "-f", str(path), sha], cwd=REPO, check=True,
                       capture_output=True)
    if not (path / "work").exists():
        (path / "work").symlink_to(REPO / "work")
    return path


def run_once(code: Path, config: str, out: Path) -> dict[str, float]:
    """One `mmrl train` of one step from the code in `code`; its start-up phases, `cpu_total` (CPU
    seconds of all its processes), `cpu/<kind>` and `ready/<kind>`."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "mmrl.cli", "train", config, "run.max_steps=1", f"run.output_dir={out}",
           "logging.progress_bar=false"]
    env = {**os.environ, "PYTHONPATH": str(code), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, cwd=code, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed in {code}:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    row = next(r for r in rows if "startup/total_s" in r)
    cpu = startup_phases(row, "startup_cpu/")
    return {**startup_phases(row), "cpu_total": sum(cpu.values()), **{f"cpu/{k}": v for k, v in cpu.items()},
            **{f"ready/{k}": v for k, v in startup_phases(row, "startup_ready/").items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/colors_demo.yaml")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--baseline", default=None, help="a git revision to measure beside the current code")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = ap.parse_args()
    config = str((REPO / args.config).resolve())
    arms = {"current": REPO}
    if args.baseline:
        arms = {f"baseline {args.baseline}": worktree(args.baseline), **arms}
    runs: dict[str, list[dict[str, float]]] = {arm: [] for arm in arms}
    for r in range(args.rounds):
        for arm, code in arms.items():
            runs[arm].append(run_once(code, config, REPO / "runs" / "startup" / arm.split()[0]))
            print(f"round {r + 1} {arm}: {runs[arm][-1]['total']:.1f} s", flush=True)
    # a key missing from a run (a kind of process that run did not have) is left out of the medians
    medians = {arm: {key: statistics.median(x[key] for x in xs) for key in xs[0] if all(key in x for x in xs)}
               for arm, xs in runs.items()}
    for arm, m in medians.items():
        phases = {p: s for p, s in m.items() if "/" not in p and p not in ("total", "cpu_total")}
        print(f"{arm}: {m['total']:.1f} s to the end of the first step ("
              + ", ".join(f"{p} {s:.1f}" for p, s in phases.items()) + f"); {m['cpu_total']:.1f} CPU-s ("
              + ", ".join(f"{k[4:]} {s:.1f}" for k, s in m.items() if k.startswith("cpu/")) + ")"
              + "".join(f"; {k[6:]} up at {s:.1f} s" for k, s in m.items() if k.startswith("ready/")))
    result = {"command": "benchmarks/startup.py " + " ".join(sys.argv[1:]), "config": args.config,
              "cores": os.cpu_count(), "runs": runs, "median_s": medians}
    if args.baseline:
        base, cur = medians[f"baseline {args.baseline}"]["total"], medians["current"]["total"]
        cpu_base, cpu_cur = medians[f"baseline {args.baseline}"]["cpu_total"], medians["current"]["cpu_total"]
        result["ratio_baseline_to_current"] = base / cur
        result["cpu_ratio_baseline_to_current"] = cpu_base / cpu_cur if cpu_cur else None
        print(f"baseline / current: {base / cur:.2f}x wall"
              + (f", {cpu_base / cpu_cur:.2f}x CPU seconds" if cpu_cur else ""))
    write_result(args.out, "startup.json", result)


if __name__ == "__main__":
    main()
