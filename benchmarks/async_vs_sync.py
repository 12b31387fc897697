"""Async vs sync rollout on a long-tail task, one command, one machine, side by side in one run.

    .venv/bin/python benchmarks/async_vs_sync.py [--steps 40] [--seed 0] [--modes sync async_k1 ...]

The task is the colors demo with long-tail responses: every trajectory generates a token budget
drawn from a Pareto distribution (4 to 256 tokens, median 8, 1.6% at 256; EOS ignored;
benchmarks/long_tail_loop.py), and the reward reads the first word. Same model, data, seed and
steps for every mode; each mode is the real `mmrl train` in its own process:

  sync              rollout, update, weight sync in turn
  async_k1          generation beside training, max_staleness 1, partial=wait (an update waits
                    for the requests in flight: every trajectory has one weight version)
  async_k2          the same with max_staleness 2
  async_k2_partial  max_staleness 2, partial=keep (requests in flight are frozen at an update and
                    continue under the new weights)

Reported per mode: trained samples/s and tokens/s (after start-up), the trainer's idle share
(step time outside the logprob and train spans), the engine's idle share, the mean reward of the
last 10 steps, and each mode's throughput ratio to sync. Writes
benchmarks/results/async_vs_sync.{json,png}.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODES: dict[str, list[str]] = {
    "sync": ["rollout.mode=sync"],
    "async_k1": ["rollout.mode=async", "rollout.max_staleness=1", "rollout.partial=wait"],
    "async_k2": ["rollout.mode=async", "rollout.max_staleness=2", "rollout.partial=wait"],
    "async_k2_partial": ["rollout.mode=async", "rollout.max_staleness=2", "rollout.partial=keep"],
}
TASK = ["rollout.agent_loop=benchmarks/long_tail_loop.py:long_tail", "rollout.max_new_tokens=256",
        "rollout.prompts_per_step=8", "rollout.group_size=8", "data.heldout_shards=null",
        "algorithm.rollout_correction.mode=tis", "checkpoint.every_steps=0", "stability.enabled=false",
        "run.time_limit_s=null",
        "logging.progress_bar=false", "logging.console_every=10"]


def run_mode(name: str, steps: int, seed: int, out_root: Path, extra: list[str]) -> dict:
    run_dir = out_root / name
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "mmrl.cli", "train", str(REPO / "configs" / "colors_demo.yaml"),
           f"run.seed={seed}", f"run.max_steps={steps}", f"run.output_dir={run_dir}", *TASK, *MODES[name], *extra]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    (out_root / f"{name}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed (exit {proc.returncode}); see {out_root}/{name}.log")
    rows = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["step"] >= 1]
    wall = rows[-1]["time/wall_s"] - (rows[0]["time/wall_s"] - rows[0]["time/step_s"])
    trajectories = 8 * 8 * len(rows)
    tokens = sum(r["actor/response_tokens"] for r in rows)
    busy = sum(r.get("time/train_s", 0.0) + r.get("time/logprob_s", 0.0) for r in rows)
    step_time = sum(r["time/step_s"] for r in rows)
    engine_idle = [r["rollout/engine_0/idle_share"] for r in rows if "rollout/engine_0/idle_share" in r]
    return {
        "mode": name, "overrides": MODES[name], "steps": len(rows), "train_wall_s": wall,
        "total_wall_s": time.time() - t0,
        "samples_per_s": trajectories / wall, "trained_tokens_per_s": tokens / wall,
        "trainer_idle_share": 1.0 - busy / step_time,
        "engine_idle_share": sum(engine_idle) / max(len(engine_idle), 1),
        "final_reward": sum(r["reward/mean"] for r in rows[-10:]) / len(rows[-10:]),
        "mean_response_tokens": sum(r["rollout/response_length"] for r in rows) / len(rows),
        "staleness_mean": sum(r.get("async/staleness_mean", 0.0) for r in rows) / len(rows),
        "dropped_stale_groups": sum(r.get("async/dropped_stale_groups", 0.0) for r in rows),
        "reward_curve": [(r["time/wall_s"], r["reward/mean"]) for r in rows],
    }


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for r in results:
        wall, reward = zip(*r["reward_curve"])
        axes[0].plot(wall, reward, label=r["mode"])
    axes[0].set_xlabel("wall time after start-up (s)")
    axes[0].set_ylabel("mean training reward")
    axes[0].legend()
    names = [r["mode"] for r in results]
    axes[1].bar(names, [r["samples_per_s"] for r in results])
    axes[1].set_ylabel("trained trajectories / s")
    fig.suptitle("long-tail rollout (4-256 tokens): sync vs async, tiny Qwen2.5-VL on this machine")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    ap.add_argument("overrides", nargs="*", help="extra key=value config overrides for every mode")
    args = ap.parse_args()
    out = Path(args.out)
    runs = out / "runs" / "async_vs_sync"
    runs.mkdir(parents=True, exist_ok=True)
    results = []
    for name in args.modes:
        results.append(run_mode(name, args.steps, args.seed, runs, args.overrides))
        r = results[-1]
        print(f"{name:<17} {r['samples_per_s']:6.2f} traj/s {r['trained_tokens_per_s']:8.1f} tok/s  "
              f"trainer idle {r['trainer_idle_share']:.2f}  engine idle {r['engine_idle_share']:.2f}  "
              f"final reward {r['final_reward']:.3f}  staleness {r['staleness_mean']:.2f}", flush=True)
    base = next((r for r in results if r["mode"] == "sync"), None)
    if base is not None:
        for r in results:
            r["throughput_ratio_vs_sync"] = r["samples_per_s"] / base["samples_per_s"]
            print(f"{r['mode']:<17} x{r['throughput_ratio_vs_sync']:.2f} samples/s vs sync, "
                  f"final reward {r['final_reward']:.3f} vs {base['final_reward']:.3f}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    (out / "async_vs_sync.json").write_text(json.dumps({"commit": commit, "steps": args.steps, "seed": args.seed, "task": TASK,
                                                        "cpu_count": os.cpu_count(), "results": results}, indent=1))
    plot(results, out / "async_vs_sync.png")
    print(f"wrote {out / 'async_vs_sync.json'} and .png")


if __name__ == "__main__":
    main()
