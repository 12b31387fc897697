"""Fault tolerance of the trainer ranks (run.max_restarts, controller/restarts.py) and of the whole
run, through the real CLI: real Ray actors, two ZeRO-3 ranks, a vLLM engine.

- A trainer rank killed with SIGKILL mid-run: the run restarts itself from its newest checkpoint
  and ends with the samples and metrics of a run that was never interrupted.
- With run.max_restarts=0 it stops instead (exit 75), naming the rank and the command that
  resumes it; running that command resumes exactly.
- The whole run killed with SIGKILL at five random points of its 40 steps and rerun each time
  ends like the uninterrupted run: the same samples every step, the same metrics, and the
  learning rate and entropy bonus of each step (their schedules run across the kills).

A run of N steps is the first N steps of a longer run with the same settings (no schedule,
evaluation or checkpoint in these settings depends on run.max_steps), so the 12-step runs are
compared step by step with the first 12 steps of the one 40-step uninterrupted run
(conftest.py's `reference_run`)."""
from __future__ import annotations

import json
import os
import random
import re
import shlex
import signal
import sys
from pathlib import Path

import pytest
from _runs import (HANG_S, assert_same_steps, kill_run, kill_test_cmd, logged_step, rows, run_to_end,
                   scheduled_coefficients, start, wait_until)

from mmrl.controller.restarts import RESUME_EXIT_CODE, RankDied, RunStopped


def _same_run(expected: Path, got: Path, steps: int) -> None:
    """`got` logged steps 0..steps once each, trained on the same samples as `expected` and
    reached the same metrics at every step."""
    want, have = rows(expected), rows(got)
    assert sorted(have) == list(range(steps + 1))  # no duplicated or missing step
    assert rows(got, "batches.jsonl") == {s: r for s, r in rows(expected, "batches.jsonl").items() if s <= steps}
    assert_same_steps(want, have, range(1, steps + 1))


def _kill_rank_after_step(run: Path, log: Path, proc, step: int, rank: int = 1) -> int:
    """SIGKILL trainer rank `rank`'s process once the run logged `step`; returns its pid."""
    wait_until(logged_step(log, step), proc, log, f"step {step}")
    pid = json.loads((run / "ranks.json").read_text())[rank]["pid"]
    os.kill(pid, signal.SIGKILL)
    return pid


def _death(text: str, pid: int) -> tuple[int, str]:
    """The step at which the run found rank 1 (pid `pid`) dead, from its message, and the newest
    checkpoint before it (checkpoint.every_steps=4; a death found while step N's checkpoint is
    written is found at step N, and that checkpoint is not complete)."""
    found = re.search(rf"trainer rank 1 \(pid {pid}, node [^)]+\) died at step (\d+)", text)
    assert found, text[-4000:]
    step = int(found.group(1))
    # killed once step 6 was logged: the next call on the ranks is in step 7 or, on a fast
    # machine that finished step 7's rollout before the kill landed, later
    assert 7 <= step <= 12, step
    return step, f"step_{4 * ((step - 1) // 4):06d}"


def _kill_rank_and_wait(run: Path, cmd: list[str], root: Path, exit_code: int, timeout_s: float) -> tuple[int, str]:
    """Start `cmd`, SIGKILL trainer rank 1 once step 6 is logged, and check the run's exit code;
    returns the killed pid and the run's log."""
    log = run.with_suffix(".log")
    proc = start(cmd, root, log)
    try:
        pid = _kill_rank_after_step(run, log, proc, 6)
        assert proc.wait(timeout=timeout_s) == exit_code, log.read_text()[-4000:]
    finally:
        if proc.poll() is None:
            kill_run(proc)
    return pid, log.read_text()


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("restarts")


@pytest.mark.slow
def test_a_killed_trainer_rank_is_restarted_from_the_newest_checkpoint(root: Path, reference_run: Path,
                                                                       tiny_model_dir: Path, colors_dir: Path) -> None:
    run = root / "rank_killed"
    # after step 6 (checkpoint at 4): steps 5 and 6 were logged and are (usually) redone after the restart
    pid, text = _kill_rank_and_wait(run, kill_test_cmd(run, tiny_model_dir, colors_dir, 12), root, 0, 2 * HANG_S)
    died, checkpoint = _death(text, pid)
    assert f"Restart 1 of run.max_restarts=2: from checkpoint {checkpoint}" in text
    _same_run(reference_run, run, 12)
    metrics = rows(run)
    assert metrics[12]["run/restarts"] == 1 and metrics[1]["run/restarts"] == 0
    events = [json.loads(line) for line in (run / "restarts.jsonl").read_text().splitlines()]
    assert [(e["rank"], e["pid"], e["step"], e["checkpoint"], e["restart"]) for e in events] == \
        [(1, pid, died, checkpoint, 1)]


@pytest.mark.slow
def test_without_restarts_the_run_stops_naming_the_rank_and_the_command_that_resumes_it(
        root: Path, reference_run: Path, tiny_model_dir: Path, colors_dir: Path) -> None:
    run = root / "stopped"
    cmd = kill_test_cmd(run, tiny_model_dir, colors_dir, 12, "run.max_restarts=0")
    pid, text = _kill_rank_and_wait(run, cmd, root, RESUME_EXIT_CODE, HANG_S)
    _, checkpoint = _death(text, pid)
    assert f"mmrl: error: trainer rank 1 (pid {pid}, node " in text
    assert f"newest checkpoint ({run / 'checkpoints' / checkpoint})" in text
    # the command it prints is the one that was typed (the CLI's arguments), and it resumes exactly
    printed = shlex.split(text.split("run the same command again:\n", 1)[1].splitlines()[0])
    assert printed == ["mmrl", *cmd[3:]]
    proc = run_to_end([sys.executable, "-m", "mmrl.cli", *printed[1:]], root)
    assert "resumed from" in proc.stdout and checkpoint in proc.stdout
    _same_run(reference_run, run, 12)


@pytest.mark.slow  # six starts of a run
def test_five_kill_9s_of_the_whole_run_and_reruns_end_like_the_uninterrupted_run(
        root: Path, reference_run: Path, tiny_model_dir: Path, colors_dir: Path) -> None:
    steps, expected = 40, reference_run
    run = root / "killed_5x"
    # kill right after a step's metrics line: during the next step, or (every 4th) while its
    # checkpoint is being written
    points = sorted(random.Random(17).sample(range(1, steps), 5))
    for i, point in enumerate(points):
        log = root / f"killed_5x.{i}.log"
        proc = start(kill_test_cmd(run, tiny_model_dir, colors_dir, steps), root, log)
        try:
            wait_until(logged_step(log, point), proc, log, f"step {point}")
        finally:
            kill_run(proc)
    proc = run_to_end(kill_test_cmd(run, tiny_model_dir, colors_dir, steps), root)
    assert "resumed from" in proc.stdout
    _same_run(expected, run, steps)
    for step, row in rows(run).items():  # each step trained with its own scheduled coefficients
        if step > 0:
            coef, lr = scheduled_coefficients(step)
            assert row["actor/entropy_coef"] == pytest.approx(coef) and row["train/lr"] == pytest.approx(lr), step
    # complete checkpoints only: what kills during a save left was tidied by the next start
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000036", "step_000040"]


# ---- the restart loop itself, with a stand-in for train() (no Ray) -------------------------------
def _config(tmp_path: Path, *overrides: str):
    from mmrl.config import load_config

    return load_config(str(Path(__file__).resolve().parents[1] / "configs" / "colors_demo.yaml"),
                       [f"run.output_dir={tmp_path}", *overrides], check_files=False)


def test_restarts_are_bounded_counted_and_logged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import mmrl.controller.train as train_module
    from mmrl.controller.checkpoint import checkpoint_dir
    from mmrl.controller.restarts import train_with_restarts

    calls: list[dict] = []

    def failing_train(cfg, hooks):
        metrics: dict = {}
        hooks.after_step(None, 1, metrics)
        calls.append(metrics)
        if len(calls) == 2:  # a checkpoint exists from the second attempt on
            (checkpoint_dir(tmp_path, 4)).mkdir(parents=True)
            (checkpoint_dir(tmp_path, 4) / "meta.json").write_text("{}")
        if len(calls) <= 3:
            raise RankDied(len(calls) % 2, 4242, "10.0.0.7", 5, RuntimeError("gone"))
        return {"steps": 8}

    monkeypatch.setattr(train_module, "train", failing_train)
    assert train_with_restarts(_config(tmp_path, "run.max_restarts=3"), command="mmrl train c.yaml a=1") == \
        {"steps": 8, "restarts": 3}
    assert [m["run/restarts"] for m in calls] == [0, 1, 2, 3]
    events = [json.loads(line) for line in (tmp_path / "restarts.jsonl").read_text().splitlines()]
    assert [(e["rank"], e["checkpoint"], e["restart"]) for e in events] == \
        [(1, None, 1), (0, "step_000004", 2), (1, "step_000004", 3)]

    calls.clear()
    with pytest.raises(RunStopped) as stopped:
        train_with_restarts(_config(tmp_path, "run.max_restarts=0"), command="mmrl train c.yaml a=1")
    message = str(stopped.value)
    assert message.startswith("trainer rank 1 (pid 4242, node 10.0.0.7) died at step 5 (RuntimeError: gone)")
    assert message.endswith("run the same command again:\n  mmrl train c.yaml a=1") and "step_000004" in message


def test_max_restarts_must_not_be_negative(tmp_path: Path) -> None:
    from mmrl.config.load import ConfigError

    with pytest.raises(ConfigError, match="run.max_restarts"):
        _config(tmp_path, "run.max_restarts=-1")
