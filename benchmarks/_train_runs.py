"""What the learning benchmarks share: build what a config's header says to build, run
`mmrl train CONFIG` as its own process, and read a run's curve from its metrics.jsonl.

A shipped task config names its assets in its header comment, as a user would type them:

    #   mmrl data build counting --out work/data/counting
    #   mmrl tiny-model --arch qwen2_5_vl --out work/tiny-vlm \\
    #     --words red,green,...    # a trailing comment is allowed

`header_commands` reads those lines (joining `\\` continuations); `ensure_assets` runs each one
whose `--out` folder is not built yet. The configs stay the one place that says what a task needs.
"""
from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
_BUILDERS = (("mmrl", "data", "build"), ("mmrl", "tiny-model"))
# What marks each builder's output folder as done.
_DONE_FILE = {"data": "dataset.json", "tiny-model": "config.json"}


def header_commands(config: Path) -> list[list[str]]:
    """The `mmrl data build` / `mmrl tiny-model` commands in the config's leading comment block,
    as argument lists (without the leading `mmrl`)."""
    lines: list[str] = []
    for raw in config.read_text().splitlines():
        if not raw.startswith("#"):
            break  # the header ends at the first YAML line
        lines.append(raw.lstrip("#").split("  #")[0].strip())
    joined, current = [], ""
    for line in lines:
        current += line  # as in a shell, backslash-newline joins the two lines with nothing between
        if current.endswith("\\"):
            current = current[:-1]
            continue
        joined.append(current)
        current = ""
    commands = []
    for line in joined:
        if not any(line.startswith(" ".join(b) + " ") for b in _BUILDERS):
            continue  # prose: not shell words
        commands.append(shlex.split(line)[1:])
    return commands


def _out_folder(command: list[str]) -> Path:
    return REPO / command[command.index("--out") + 1]


def ensure_assets(config: Path) -> list[list[str]]:
    """Run each header command whose output folder is not built yet; returns the commands run."""
    ran = []
    for command in header_commands(config):
        if (_out_folder(command) / _DONE_FILE[command[0]]).exists():
            continue
        subprocess.run([sys.executable, "-m", "mmrl.cli", *command], cwd=REPO, check=True,
                       env={**os.environ, "HF_HUB_OFFLINE": "1"})
        ran.append(command)
    return ran


def train(config: Path, run_dir: Path, overrides: list[str], log: Path) -> tuple[list[dict[str, Any]], float, int]:
    """`mmrl train config overrides` into a fresh run_dir (an old checkpoint there would resume);
    returns the metric rows, the wall seconds of the whole command, and its exit code. Raises if
    the run wrote no metrics at all (it failed before its first step; the log says why)."""
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "-m", "mmrl.cli", "train", str(config), f"run.output_dir={run_dir}",
           "logging.progress_bar=false", "logging.console_every=25", *overrides]
    t0 = time.time()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    total = time.time() - t0
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(proc.stdout + proc.stderr)
    if not (run_dir / "metrics.jsonl").exists():
        raise SystemExit(f"{run_dir.name} failed (exit {proc.returncode}); see {log}")
    return read_rows(run_dir), total, proc.returncode


def read_rows(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def heldout_curve(rows: list[dict[str, Any]]) -> list[tuple[int, float, float]]:
    """(step, held-out accuracy, training wall seconds) at every evaluation."""
    return [(r["step"], r["eval/heldout_accuracy"], r["time/wall_s"]) for r in rows if "eval/heldout_accuracy" in r]


def curve_summary(rows: list[dict[str, Any]], target: float) -> dict[str, Any]:
    """The curve, the first evaluation at or above `target` (step and training seconds), the
    final and best values, and the mean step time."""
    curve = heldout_curve(rows)
    hit = next(((s, w) for s, a, w in curve if a >= target), None)
    return {"curve": curve, "steps_to_target": hit[0] if hit else None,
            "train_wall_to_target_s": hit[1] if hit else None,
            "final": curve[-1][1] if curve else None, "best": max((a for _, a, _ in curve), default=None),
            "steps": rows[-1]["step"] if rows else 0,
            "mean_step_s": sum(r.get("time/step_s", 0.0) for r in rows) / max(1, len(rows) - 1)}


def add_run_args(ap: Any, *, seeds: list[int], max_steps: int | None, max_steps_help: str = "") -> None:
    """The arguments every learning benchmark takes: seeds, target, step budget, output folder,
    --merge / --collect, and key=value overrides for every run."""
    ap.add_argument("--seeds", type=int, nargs="+", default=seeds)
    ap.add_argument("--target", type=float, default=0.9)
    ap.add_argument("--max-steps", type=int, default=max_steps, help=max_steps_help or None)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    ap.add_argument("--merge", action="store_true", help="keep the other runs already in the JSON")
    ap.add_argument("--collect", action="store_true",
                    help="train nothing: summarise the run folders already on disk (e.g. a run stopped by hand)")
    ap.add_argument("overrides", nargs="*", help="extra key=value config overrides (every run)")
