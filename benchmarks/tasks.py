"""Does every shipped task learn from a random tiny VLM, and how fast? Each recipe's config
(configs/<task>.yaml) from random init on several seeds: steps and seconds to the target held-out
success, the curve and the final value.

    .venv/bin/python benchmarks/tasks.py [--tasks counting multi_image grounding video_motion] \
        [--seeds 0 1 2] [--target 0.9] [--max-steps N] [--merge] [key=value ...]

Each (task, seed) is the real `mmrl train configs/<task>.yaml run.seed=S` as its own process
(vLLM engine, 2 ZeRO-3 ranks, Ray), stopped once held-out success reaches --target or at the
config's own `run.max_steps` (or --max-steps). Held-out success is the config's evaluation:
greedy decoding, correct when the summed reward >= `eval.threshold` (for grounding that is an IoU
threshold, see configs/grounding.yaml). What each config needs (the recipe's shards, the tiny
model) is built first if missing, by the commands in the config's header. Writes
benchmarks/results/tasks.json and tasks.png (a panel per task) and prints one row per run and a
table per task.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from _plots import accuracy_axes, panels, save  # noqa: E402
from mmrl.utils.paths import repo_relative  # noqa: E402
from _train_runs import add_run_args, curve_summary, ensure_assets, read_rows, train  # noqa: E402

TASKS = ("counting", "multi_image", "grounding", "video_motion", "colors_demo")
DEFAULT_TASKS = TASKS[:4]  # colors_demo has its own benchmark (colors_learning.py)


def run(task: str, seed: int, target: float, max_steps: int | None, extra: list[str], runs: Path) -> dict:
    config = REPO / "configs" / f"{task}.yaml"
    ensure_assets(config)
    overrides = [f"run.seed={seed}", f"run.stop_at_heldout_accuracy={target}",
                 *([f"run.max_steps={max_steps}"] if max_steps else []), *extra]
    name = f"{task}-seed{seed}"
    rows, total, exit_code = train(config, runs / name, overrides, runs / f"{name}.log")
    return record(rows, task, seed, target, " ".join(["mmrl", "train", f"configs/{task}.yaml", *overrides]),
                  total, exit_code)


def record(rows: list[dict], task: str, seed: int, target: float, command: str, total_s: float | None,
           exit_code: int | None) -> dict:
    """One run: its curve summary, the start-up seconds (the command's wall time beyond training)
    and the command that reproduces it."""
    s = curve_summary(rows, target)
    return {"task": task, "seed": seed, "command": command, "exit_code": exit_code, **s,
            "total_wall_s": total_s,
            "startup_s": (total_s - rows[-1]["time/wall_s"]) if total_s is not None and rows else None}


def table(results: list[dict], target: float) -> str:
    lines = [f"| task | seeds at {target} | steps to {target} (median) | training s to {target} (median) | final (per seed) |",
             "|---|---|---|---|---|"]
    for task in TASKS:
        runs = sorted((r for r in results if r["task"] == task), key=lambda r: r["seed"])
        if not runs:
            continue
        hits = [r for r in runs if r["steps_to_target"] is not None]
        steps = statistics.median(r["steps_to_target"] for r in hits) if hits else None
        secs = statistics.median(r["train_wall_to_target_s"] for r in hits) if hits else None
        finals = ", ".join(f"{r['final']:.2f}" for r in runs)
        lines.append(f"| {task} | {len(hits)}/{len(runs)} | {steps if steps is not None else '-'} | "
                     f"{round(secs) if secs is not None else '-'} | {finals} |")
    return "\n".join(lines)


def plot(results: list[dict], target: float, path: Path) -> None:
    tasks = [t for t in TASKS if any(r["task"] == t for r in results)]
    if not tasks:
        return
    fig, axes = panels(1, len(tasks))
    for ax, task in zip(axes[0], tasks):
        for r in sorted((r for r in results if r["task"] == task), key=lambda r: r["seed"]):
            steps, acc, _ = zip(*r["curve"])
            ax.plot(steps, acc, label=f"seed {r['seed']}")
        accuracy_axes(ax, "step", "held-out success (greedy)", task, target)
    save(fig, "recipe tasks: tiny Qwen2.5-VL from random init, GRPO, vLLM + ZeRO-3 on 2 CPU cores", path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", nargs="+", default=list(DEFAULT_TASKS), choices=list(TASKS))
    add_run_args(ap, seeds=[0, 1, 2], max_steps=None, max_steps_help="default: each config's run.max_steps")
    args = ap.parse_args()
    out = Path(args.out)
    runs = out / "runs" / "tasks"
    runs.mkdir(parents=True, exist_ok=True)
    path = out / "tasks.json"
    results = json.loads(path.read_text())["runs"] if (args.merge or args.collect) and path.exists() else []
    for task in args.tasks:
        for seed in args.seeds:
            if args.collect:
                run_dir = runs / f"{task}-seed{seed}"
                if not (run_dir / "metrics.jsonl").exists():
                    continue
                r = record(read_rows(run_dir), task, seed, args.target,
                           f"(collected from disk: {repo_relative(run_dir, REPO)}/config.yaml)", None, None)
            else:
                r = run(task, seed, args.target, args.max_steps, args.overrides, runs)
            results = [x for x in results if (x["task"], x["seed"]) != (task, seed)] + [r]
            print(f"{task:12s} seed {seed}: steps to {args.target}: {r['steps_to_target']}, training s "
                  f"{r['train_wall_to_target_s'] and round(r['train_wall_to_target_s'])}, best {r['best']:.3f}, "
                  f"final {r['final']:.3f} after {r['steps']} steps, {r['mean_step_s']:.2f} s/step", flush=True)
            path.write_text(json.dumps({"target": args.target, "runs": results}, indent=1))
    print(table(results, args.target))
    plot(results, args.target, out / "tasks.png")


if __name__ == "__main__":
    main()
