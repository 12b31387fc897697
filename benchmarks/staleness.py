"""How stale can you go? The default demo in async mode for several staleness bounds k, with and
without the off-policy correction, against sync; held-out accuracy against steps and wall time.

    .venv/bin/python benchmarks/staleness.py [--ks 0 1 2 4 8] [--seed 0] [--budget-s 420] [--target 0.95]

Each run is the real `mmrl train configs/colors_demo.yaml` (colors_learning.py's runner) with
  sync:                 rollout.mode=sync (the reference)
  k, corrected:         rollout.mode=async rollout.max_staleness=k, the decoupled objective: PPO clip
                        on pi/pi_prox (pi_prox: the policy before the update) times the TIS weight pi_prox/mu
  k, uncorrected:       rollout.mode=async rollout.max_staleness=k algorithm.old_logprobs=behaviour
                        algorithm.rollout_correction.mode=none: the PPO ratio against the stale
                        behaviour policy mu itself, what a naive async loop does
Writes benchmarks/results/staleness.{json,png} and prints, per run, steps and seconds to --target,
accuracy at the end, and the mean staleness of the trained groups.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _plots import accuracy_axes, panels, save  # noqa: E402
from colors_learning import REPO, run_seed  # noqa: E402

CORRECTED = ["algorithm.old_logprobs=auto", "algorithm.rollout_correction.mode=tis"]
UNCORRECTED = ["algorithm.old_logprobs=behaviour", "algorithm.rollout_correction.mode=none"]


def runs(ks: list[int]) -> list[tuple[str, list[str]]]:
    out: list[tuple[str, list[str]]] = [("sync", ["rollout.mode=sync"])]
    for k in ks:
        base = ["rollout.mode=async", f"rollout.max_staleness={k}"]
        out.append((f"k={k} corrected", base + CORRECTED))
        if k > 0:  # at k=0 every token is the current policy's: nothing stale to correct
            out.append((f"k={k} uncorrected", base + UNCORRECTED))
    return out


def staleness_stats(run_dir: Path) -> dict[str, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    mean = [r["async/staleness_mean"] for r in rows if "async/staleness_mean" in r]
    dropped = sum(r.get("async/dropped_stale_groups", 0.0) for r in rows)
    diff = [r["mismatch/mean_abs_logprob_diff"] for r in rows if "mismatch/mean_abs_logprob_diff" in r]
    return {"staleness_mean": sum(mean) / len(mean) if mean else 0.0, "dropped_stale_groups": dropped,
            "mismatch_mean_abs_logprob_diff": sum(diff) / len(diff) if diff else 0.0}


def plot(results: list[dict], target: float, path: Path) -> None:
    fig, axes = panels(2, 2, (6.0, 4.0), sharey=True)
    for row, kind in enumerate(("corrected", "uncorrected")):
        for r in results:
            if r["label"] != "sync" and not r["label"].endswith(" " + kind):
                continue
            steps, acc, wall = zip(*r["curve"])
            style = {"color": "black", "lw": 2} if r["label"] == "sync" else {}
            axes[row][0].plot(steps, acc, label=r["label"], **style)
            axes[row][1].plot([w + r["startup_s"] for w in wall], acc, label=r["label"], **style)
        for ax, xlabel in zip(axes[row], ["step", "wall time incl. start-up (s)"]):
            accuracy_axes(ax, xlabel, f"held-out accuracy ({kind})", target=target)
    save(fig, "colors demo, async with staleness bound k (2 CPU cores): pi_prox + TIS (top) vs ratio to mu (bottom)", path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2, 4, 8])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target", type=float, default=0.95)
    ap.add_argument("--budget-s", type=float, default=420.0, help="training wall-time limit per run")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    ap.add_argument("--only", nargs="*", help="run only these labels (e.g. 'k=4 corrected')")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary_path = out / "staleness.json"
    # a rerun with --only keeps the other runs' results
    old = json.loads(summary_path.read_text())["results"] if summary_path.exists() and args.only else []
    results = [r for r in old if r["label"] not in (args.only or [])]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    for label, overrides in runs(args.ks):
        if args.only and label not in args.only:
            continue
        root = out / "runs" / "staleness" / label.replace(" ", "_").replace("=", "")
        r = run_seed(args.seed, args.target, args.budget_s, overrides, root)
        r.update(label=label, overrides=overrides, commit=commit, **staleness_stats(root / f"seed{args.seed}"))
        results.append(r)
        print(f"{label:>16}: steps to {args.target}: {r['steps_to_target']}, s to target incl. start-up: "
              f"{r['total_wall_to_target_s'] and round(r['total_wall_to_target_s'])}, final acc "
              f"{r['final_accuracy']:.3f}, mean step {r['mean_step_s']:.2f}s, staleness mean "
              f"{r['staleness_mean']:.2f}, dropped stale {r['dropped_stale_groups']:.0f}", flush=True)
        summary_path.write_text(json.dumps({"target": args.target, "budget_s": args.budget_s, "seed": args.seed,
                                            "results": results}, indent=1))
    order = {label: i for i, (label, _) in enumerate(runs(args.ks))}
    results.sort(key=lambda r: order.get(r["label"], len(order)))
    summary_path.write_text(json.dumps({"target": args.target, "budget_s": args.budget_s, "seed": args.seed,
                                        "results": results}, indent=1))
    plot(results, args.target, out / "staleness.png")
    print(f"wrote {summary_path} and {out / 'staleness.png'}")


if __name__ == "__main__":
    main()
