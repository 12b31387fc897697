"""Do the tool tasks learn, and do they need the tool? zoom_read and gui_click from a random tiny
VLM, with the tools and without them (the control), held-out success vs steps, per seed.

    .venv/bin/python benchmarks/tool_tasks.py [--tasks zoom_read gui_click] [--seeds 0] \
        [--arms tools no_tools] [--target 0.9] [--max-steps N]

Each (task, arm, seed) runs the real `mmrl train configs/<task>.yaml` as its own process (vLLM
engine, the multi_turn agent loop with the task's tool, 2 ZeRO-3 ranks, Ray). The `tools` arm is
the config as shipped and stops once held-out success reaches --target; the `no_tools` arm is the
same config with `rollout.agent_loop_args.tools=[]` and `tool_choice=auto` (one free answer, no
call possible) and runs the whole step budget: the config's own `run.max_steps` and
`run.time_limit_s` (or --max-steps). The recipes' data and the tiny models are built
first if missing (the commands in each config's header). Writes benchmarks/results/tool_tasks.json
and tool_tasks.png (a panel per task) and prints one row per run.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from _plots import accuracy_axes, panels, save  # noqa: E402
from mmrl.utils.paths import repo_relative  # noqa: E402
from _train_runs import add_run_args, curve_summary, ensure_assets, read_rows, train  # noqa: E402

TASKS = ("zoom_read", "gui_click")
NO_TOOLS = ["rollout.agent_loop_args.tools=[]", "rollout.agent_loop_args.tool_choice=auto"]


def run(task: str, arm: str, seed: int, target: float, max_steps: int | None, extra: list[str],
        out_root: Path) -> dict:
    """One (task, arm, seed) run. The step budget and time limit are the config's own (each tool
    task states its budget) unless --max-steps or a run.* override replaces them."""
    name = f"{task}-{arm}-seed{seed}"
    overrides = [f"run.seed={seed}", *([f"run.max_steps={max_steps}"] if max_steps else [])]
    overrides += [f"run.stop_at_heldout_accuracy={target}"] if arm == "tools" else NO_TOOLS
    rows, total, exit_code = train(REPO / "configs" / f"{task}.yaml", out_root / name, [*overrides, *extra],
                                   out_root / f"{name}.log")
    command = " ".join(["mmrl", "train", f"configs/{task}.yaml", *overrides, *extra])
    return summarise(rows, task, arm, seed, target, command, total, exit_code)


def summarise(rows: list[dict], task: str, arm: str, seed: int, target: float, command: str,
              total_s: float | None, exit_code: int | None) -> dict:
    """One run's record from its metric rows. A run that exited non-zero (stopped by hand, or
    crashed after some steps) is kept as what it reached, with its exit code."""
    s = curve_summary(rows, target)
    calls = [r["agent/tool_calls"] for r in rows if "agent/tool_calls" in r]
    return {"task": task, "arm": arm, "seed": seed, "command": command, "exit_code": exit_code,
            "curve": s["curve"], "steps_to_target": s["steps_to_target"],
            "train_wall_to_target_s": s["train_wall_to_target_s"], "total_wall_s": total_s,
            "final_success": s["final"], "best_success": s["best"], "steps": s["steps"],
            "mean_tool_calls_last_10": sum(calls[-10:]) / max(1, len(calls[-10:])),
            "mean_step_s": s["mean_step_s"]}


def plot(results: list[dict], target: float, path: Path) -> None:
    tasks = sorted({r["task"] for r in results}, key=list(TASKS).index)
    if not tasks:
        return
    fig, axes = panels(1, len(tasks))
    for ax, task in zip(axes[0], tasks):
        for r in (r for r in results if r["task"] == task):
            steps, acc, _ = zip(*r["curve"])
            ax.plot(steps, acc, ls="-" if r["arm"] == "tools" else ":",
                    label=f"{'with tool' if r['arm'] == 'tools' else 'tools disabled'}, seed {r['seed']}")
        accuracy_axes(ax, "step", "held-out success (greedy)", task, target)
    save(fig, "tool tasks: tiny Qwen2.5-VL from random init, GRPO, multi_turn loop, 2 CPU cores", path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    ap.add_argument("--arms", nargs="+", default=["tools", "no_tools"], choices=["tools", "no_tools"])
    add_run_args(ap, seeds=[0], max_steps=None,
                 max_steps_help="step budget of every run (default: each config's run.max_steps)")
    args = ap.parse_args()
    out = Path(args.out)
    runs_root = out / "runs" / "tool_tasks"
    runs_root.mkdir(parents=True, exist_ok=True)
    path = out / "tool_tasks.json"
    results = json.loads(path.read_text())["runs"] if args.merge and path.exists() else []
    for task in args.tasks:
        if not args.collect:
            ensure_assets(REPO / "configs" / f"{task}.yaml")
        for arm in args.arms:
            for seed in args.seeds:
                if args.collect:
                    run_dir = runs_root / f"{task}-{arm}-seed{seed}"
                    if not (run_dir / "metrics.jsonl").exists():
                        continue
                    r = summarise(read_rows(run_dir), task, arm, seed, args.target, f"(collected from disk: {repo_relative(run_dir, REPO)}/config.yaml)", None, None)
                else:
                    r = run(task, arm, seed, args.target, args.max_steps, args.overrides, runs_root)
                results = [x for x in results if (x["task"], x["arm"], x["seed"]) != (task, arm, seed)] + [r]
                print(f"{task:10s} {arm:9s} seed {seed}: steps to {args.target}: {r['steps_to_target']}, "
                      f"seconds {r['train_wall_to_target_s'] and round(r['train_wall_to_target_s'])}, "
                      f"best {r['best_success']:.3f}, final {r['final_success']:.3f} after {r['steps']} steps, "
                      f"{r['mean_step_s']:.2f} s/step", flush=True)
                path.write_text(json.dumps({"target": args.target, "max_steps": args.max_steps, "runs": results},
                                           indent=1))
    plot(results, args.target, out / "tool_tasks.png")


if __name__ == "__main__":
    main()
