"""Seconds from `mmrl train` to the end of its first step, phase by phase.

    .venv/bin/python benchmarks/startup.py [--config configs/colors_demo.yaml] [--rounds 3] \
        [--baseline REV]

Runs `mmrl train CONFIG run.max_steps=1` `--rounds` times and reads the
`startup/<phase>_s` metrics the first step logs (imports, ray, processor, workers_started,
engines_and_ranks, rollout_workers_ready, data, first_eval, first_step; from the process start).
With `--baseline REV`, the same command from a git worktree of REV (this venv, REV's code) runs in
alternate rounds, so a start-up change is measured side by side; the ratio is baseline / current.
Also reads vLLM's own start-up lines from the engine's log when present. Prints medians per phase
and writes benchmarks/results/startup.json. Goal (issue 15): <= 15 s for the demo on this machine.
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
    """One `mmrl train` of one step from the code in `code`; its start-up metrics."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "mmrl.cli", "train", config, "run.max_steps=1", f"run.output_dir={out}",
           "logging.progress_bar=false"]
    env = {**os.environ, "PYTHONPATH": str(code), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, cwd=code, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed in {code}:\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return startup_phases(next(r for r in rows if "startup/total_s" in r))


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
    medians = {arm: {phase: statistics.median(x[phase] for x in xs) for phase in xs[0]} for arm, xs in runs.items()}
    for arm, m in medians.items():
        print(f"{arm}: {m['total']:.1f} s to the end of the first step ("
              + ", ".join(f"{p} {s:.1f}" for p, s in m.items() if p != "total") + ")")
    result = {"command": "benchmarks/startup.py " + " ".join(sys.argv[1:]), "config": args.config,
              "cores": os.cpu_count(), "runs": runs, "median_s": medians}
    if args.baseline:
        base, cur = medians[f"baseline {args.baseline}"]["total"], medians["current"]["total"]
        result["ratio_baseline_to_current"] = base / cur
        print(f"baseline / current: {base / cur:.2f}x")
    write_result(args.out, "startup.json", result)


if __name__ == "__main__":
    main()
