"""`mmrl train` as a subprocess, for the tests that kill runs and compare them with runs that were
never interrupted (test_restarts.py, test_export.py): the command, a run started in its own
process group, waits on its files and its own log (never on the clock: hang guards only), a
SIGKILL of the whole run, and the comparison of two runs' records."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterable

import pytest

REPO = Path(__file__).resolve().parents[1]
HANG_S = 900.0  # a hang guard for one wait, sized for a loaded 2-core machine; not a speed check


def train_cmd(run_dir: Path, model: Path, data: Path, *overrides: str) -> list[str]:
    """The colours demo on the tiny model and the test shards, into `run_dir`."""
    return [sys.executable, "-m", "mmrl.cli", "train", str(REPO / "configs" / "colors_demo.yaml"),
            f"model.path={model}", f"data.train_shards={data}/train-{{000000..000001}}.tar",
            f"data.heldout_shards={data}/heldout-000000.tar", f"run.output_dir={run_dir}", "run.time_limit_s=null",
            "logging.progress_bar=false", *overrides]


# The learning rate and the entropy bonus both fade over steps 10-30 of the kill/resume runs: a
# resumed run must use the coefficients of the step it resumes at (a function of the step alone).
SCHEDULE_START, SCHEDULE_STEPS, LR, LR_END_FACTOR, ENTROPY_COEF = 10, 20, 5e-4, 0.5, 0.1


def kill_test_cmd(run_dir: Path, model: Path, data: Path, steps: int, *overrides: str) -> list[str]:
    """The run the kill/resume tests start, kill and compare: small steps (4 prompts x 4 samples),
    a held-out set of 8, a checkpoint every 4 steps (the time goes to the starts), and the
    schedules above."""
    return train_cmd(run_dir, model, data, f"run.max_steps={steps}", "rollout.prompts_per_step=4",
                     "rollout.group_size=4", "eval.every_steps=4", "eval.num_prompts=8", "checkpoint.every_steps=4",
                     "checkpoint.keep_last=2", "logging.console_every=1", f"trainer.lr={LR}",
                     f"algorithm.entropy_coef={ENTROPY_COEF}", "algorithm.entropy_schedule.kind=linear",
                     f"algorithm.entropy_schedule.start_step={SCHEDULE_START}",
                     f"algorithm.entropy_schedule.steps={SCHEDULE_STEPS}", "algorithm.entropy_schedule.end_coef=0.0",
                     "trainer.lr_schedule.kind=linear", f"trainer.lr_schedule.start_step={SCHEDULE_START}",
                     f"trainer.lr_schedule.steps={SCHEDULE_STEPS}", f"trainer.lr_schedule.end_factor={LR_END_FACTOR}",
                     *overrides)


def scheduled_coefficients(step: int) -> tuple[float, float]:
    """(entropy coefficient, learning rate) that step `step` of `kill_test_cmd`'s run trains with."""
    faded = min(max((step - SCHEDULE_START) / SCHEDULE_STEPS, 0.0), 1.0)
    return ENTROPY_COEF * (1 - faded), LR * (1 - (1 - LR_END_FACTOR) * faded)


def run_env() -> dict[str, str]:
    # unbuffered: a step's console line is in the log when the step is logged (logged_step)
    return {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def rows(run_dir: Path, name: str = "metrics.jsonl") -> dict[int, dict]:
    """A run's records by step (metrics.jsonl, batches.jsonl)."""
    return {r["step"]: r for r in map(json.loads, (run_dir / name).read_text().splitlines())}


def run_to_end(cmd: list[str], cwd: Path, timeout: float = HANG_S) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=run_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def start(cmd: list[str], cwd: Path, log: Path) -> subprocess.Popen:
    """Start a run in its own process group (kill_run kills all of it), stdout and stderr to `log`."""
    with open(log, "w") as out:
        return subprocess.Popen(cmd, cwd=cwd, env=run_env(), stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def wait_until(ready: Callable[[], bool], proc: subprocess.Popen, log: Path, what: str) -> None:
    """Wait until `ready()` while the run is alive; fail with its log if it ends first (or hangs)."""
    deadline = time.time() + HANG_S
    while not ready() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    assert ready() and proc.poll() is None, f"the run ended (or hung) before {what}:\n" + log.read_text()[-4000:]


def logged_step(log: Path, step: int) -> Callable[[], bool]:
    """True once this process logged step `step` (its console line; logging.console_every=1)."""
    return lambda: f"[step {step}] " in log.read_text()


def kill_run(proc: subprocess.Popen) -> None:
    """SIGKILL the whole run (driver, Ray, engines, ranks), then remove the shared memory it left."""
    from mmrl.utils.env import cleanup_shm

    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    cleanup_shm()


def assert_same_steps(expected: dict[int, dict], got: dict[int, dict], steps: Iterable[int]) -> None:
    """The same rollouts, rewards, losses, gradients, weights versions and held-out accuracy at
    each of `steps` (the tolerances of an exact resume: float noise only)."""
    for step in steps:
        a, b = expected[step], got[step]
        assert b["reward/mean"] == pytest.approx(a["reward/mean"], abs=1e-9), step
        assert b["rollout/response_length"] == a["rollout/response_length"], step
        for key in ("loss/pg", "actor/entropy", "actor/grad_norm"):
            assert b[key] == pytest.approx(a[key], rel=1e-6, abs=1e-9), (step, key, a[key], b[key])
        assert b["weight_version"] == a["weight_version"], step
        assert b.get("eval/heldout_accuracy") == a.get("eval/heldout_accuracy"), step
        for key in ("actor/entropy_coef", "train/lr", "train/lr_scale"):  # schedules restored where they stood
            assert b.get(key) == a.get(key), (step, key, a.get(key), b.get(key))
