"""The shipped task configs (configs/*.yaml): each one is runnable by following its own header,
and each recipe's config learns, seeded and shortened, clearly above chance through the real CLI
(shards -> vLLM in Ray -> rewards -> 2 ZeRO-3 ranks -> weight sync). benchmarks/tasks.py runs the
same configs to the 0.9 target on 3 seeds."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mmrl.config import load_config

REPO = Path(__file__).resolve().parents[1]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


def _train_runs():
    spec = importlib.util.spec_from_file_location("_train_runs", REPO / "benchmarks" / "_train_runs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_header_commands_join_continuations_and_skip_prose(tmp_path: Path) -> None:
    config = tmp_path / "task.yaml"
    config.write_text("# A task: it's built like this (prose with a quote is not a command).\n"
                      "#   mmrl data build counting --out work/data/counting max_count=4\n"
                      "#   mmrl tiny-model --arch qwen2_5_vl --out work/tiny-x \\\n"
                      "#     --words one,two,\\\n"
                      "#   three    # a comment after the command\n"
                      "#   mmrl train configs/task.yaml\n"
                      "run:\n  name: x\n# mmrl data build colors --out not/the/header\n")
    assert _train_runs().header_commands(config) == [
        ["data", "build", "counting", "--out", "work/data/counting", "max_count=4"],
        ["tiny-model", "--arch", "qwen2_5_vl", "--out", "work/tiny-x", "--words", "one,two,three"]]




def _built_here(config: Path) -> bool:
    cfg = load_config(str(config), [], check_files=False)
    return cfg.data.train_shards.startswith("work/") and cfg.model.path.startswith("work/")


# The configs that run here from nothing: their shards and model are built locally (work/); the
# others (a 7B model from the hub) are checked by tests/test_memory_plan.py's dry runs.
LOCAL = [c for c in CONFIGS if _built_here(c)]


def test_every_recipe_has_a_local_config() -> None:
    assert {"colors_demo", "counting", "multi_image", "grounding", "zoom_read", "gui_click"} <= {c.stem for c in LOCAL}


@pytest.mark.parametrize("config", [c for c in LOCAL if c.stem != "colors_demo"], ids=lambda c: c.stem)
def test_a_task_config_builds_what_it_reads(config: Path) -> None:
    """The shards and the model a task config reads are the folders its header's commands build,
    so a user who runs the header's lines gets a config that starts. (The demo's assets come from
    `make assets`, the README's first command.)"""
    cfg = load_config(str(config), [], check_files=False)
    built = {c[c.index("--out") + 1]: c for c in _train_runs().header_commands(config)}
    data = [c for c in built.values() if c[:2] == ["data", "build"]]
    assert data, f"{config.name}: no `mmrl data build` line in its header"
    for shards in (cfg.data.train_shards, cfg.data.heldout_shards):
        assert any(shards.startswith(out + "/") for out in built), (shards, list(built))
    assert cfg.model.path in built and built[cfg.model.path][0] == "tiny-model", (cfg.model.path, list(built))


# task -> (chance level of held-out success, what a short seeded run must reach, step budget).
# Measured with the shipped configs (full shards, benchmarks/results/tasks.json): counting passed 0.5
# at steps 230 / 515 / 400 and 0.9 at 435 / 580 / 640 (seeds 0 / 1 / 2); seed 0 runs here.
LEARNS = {
    "counting": (0.2, 0.5, 350),
}


@pytest.mark.slow
@pytest.mark.learning  # not in CI (`make test-learning`): each run takes tens of minutes on 2 cores
@pytest.mark.timeout(7200)  # a busy machine can triple the run; the bound is for hangs only
@pytest.mark.parametrize("task", list(LEARNS))
def test_task_config_learns(task: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    """The config as shipped (its own recipe's shards, built small here) moves held-out success
    clearly above chance within a short seeded run."""
    chance, reach, max_steps = LEARNS[task]
    config = REPO / "configs" / f"{task}.yaml"
    cfg = load_config(str(config), [], check_files=False)
    data = tmp_path / "data"
    build = next(c for c in _train_runs().header_commands(config) if c[:2] == ["data", "build"])
    out = build.index("--out")
    subprocess.run([sys.executable, "-m", "mmrl.cli", *build[:out], "--out", str(data), *build[out + 2:],
                    "train_size=1024", "heldout_size=64", "shard_size=512"], check=True, cwd=REPO)
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "mmrl.cli", "train", str(config), f"model.path={tiny_model_dir}",
           f"data.train_shards={data}/train-{{000000..000001}}.tar", f"data.heldout_shards={data}/heldout-000000.tar",
           f"run.output_dir={run_dir}", "run.seed=0", f"run.max_steps={max_steps}",
           f"run.stop_at_heldout_accuracy={reach}", "run.time_limit_s=null", "logging.progress_bar=false",
           "checkpoint.every_steps=1000"]
    proc = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=7000,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    curve = [(r["step"], r["eval/heldout_accuracy"]) for r in rows if "eval/heldout_accuracy" in r]
    assert curve[0][1] <= chance + 0.15, f"an untrained random model should be near chance, got {curve[0]}"
    assert max(a for _, a in curve) >= reach, f"{task}: held-out success never reached {reach}: {curve}"
    assert cfg.rollout.group_size > 1 and max(r["mismatch/mean_abs_logprob_diff"] for r in rows if r["step"]) < 1e-4
