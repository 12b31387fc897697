"""Long-run stability: does the default demo, continued for many steps, hold its accuracy?

    .venv/bin/python benchmarks/long_run.py [--steps 1500] [--hold 0.95] [--plot-only]

Runs the real `mmrl train configs/colors_demo.yaml run.max_steps=STEPS` (no time limit; the
config's checkpoints and stability guard as shipped) in benchmarks/results/runs/long_run. If the
command is interrupted, running it again resumes from the newest checkpoint. Prints the first
step that reaches --hold, the lowest held-out accuracy after it, the step from which every
evaluation stays at or above --hold (and the lowest after it), and the guard's rollbacks;
writes benchmarks/results/long_run.{json,png}.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def summarise(run_dir: Path, hold: float) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    curve = [(r["step"], r["eval/heldout_accuracy"]) for r in rows if "eval/heldout_accuracy" in r]
    first = next((s for s, a in curve if a >= hold), None)
    after = [a for s, a in curve if first is not None and s >= first]
    rollbacks = []
    if (run_dir / "guard.jsonl").exists():
        rollbacks = [json.loads(line) for line in (run_dir / "guard.jsonl").read_text().splitlines()]
    # settled: from this evaluation on, every evaluation is at or above `hold`
    settled = next((s for i, (s, _) in enumerate(curve) if all(a >= hold for _, a in curve[i:])), None)
    after_settled = [a for s, a in curve if settled is not None and s >= settled]
    return {"steps": rows[-1]["step"], "curve": curve, "first_step_at_hold": first,
            "settled_step": settled, "min_after_settled": min(after_settled) if after_settled else None,
            "evals_after_settled": len(after_settled),
            "min_after_first": min(after) if after else None,
            "evals_below_hold_after_first": sum(a < hold for a in after), "evals_after_first": len(after),
            "final": curve[-1][1] if curve else None, "rollbacks": rollbacks,
            "reward": [(r["step"], r["reward/mean"]) for r in rows if "reward/mean" in r],
            "entropy": [(r["step"], r["actor/entropy"]) for r in rows if "actor/entropy" in r]}


def plot(summary: dict, hold: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    axes[0].plot(*zip(*summary["curve"]))
    axes[0].axhline(hold, color="grey", ls="--", lw=1)
    axes[0].set_ylabel("held-out accuracy (greedy)")
    axes[0].set_ylim(0, 1.02)
    axes[1].plot(*zip(*summary["reward"]), lw=0.6)
    axes[1].set_ylabel("reward/mean")
    axes[2].plot(*zip(*summary["entropy"]), lw=0.6)
    axes[2].set_ylabel("actor/entropy")
    for ax in axes:
        ax.set_xlabel("step")
        for event in summary["rollbacks"]:
            ax.axvline(event["at_step"], color="red", lw=0.8)
    fig.suptitle(f"default demo continued to {summary['steps']} steps (red: stability-guard rollbacks)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--hold", type=float, default=0.95)
    ap.add_argument("--plot-only", action="store_true", help="summarise the existing run directory")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    out = Path(args.out)
    run_dir = out / "runs" / "long_run"
    if not args.plot_only:
        cmd = [sys.executable, "-m", "mmrl.cli", "train", str(REPO / "configs" / "colors_demo.yaml"),
               f"run.max_steps={args.steps}", "run.time_limit_s=null", f"run.output_dir={run_dir}",
               "logging.progress_bar=false", "logging.console_every=50", *args.overrides]
        proc = subprocess.run(cmd, cwd=REPO, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        if proc.returncode != 0:
            raise SystemExit(f"training failed (exit {proc.returncode})")
    summary = summarise(run_dir, args.hold)
    (out / "long_run.json").write_text(json.dumps({k: v for k, v in summary.items() if k not in ("reward", "entropy")},
                                                  indent=1))
    plot(summary, args.hold, out / "long_run.png")
    print(f"steps {summary['steps']}; first reached {args.hold} at step {summary['first_step_at_hold']}; lowest "
          f"held-out accuracy after that {summary['min_after_first']}; evaluations below {args.hold} after it: "
          f"{summary['evals_below_hold_after_first']}/{summary['evals_after_first']}; at or above {args.hold} at every "
          f"evaluation from step {summary['settled_step']} on ({summary['evals_after_settled']} evaluations, lowest "
          f"{summary['min_after_settled']}); final {summary['final']}; guard rollbacks: {len(summary['rollbacks'])}")


if __name__ == "__main__":
    main()
