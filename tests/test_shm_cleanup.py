"""A run removes its own DeepSpeed shared-memory all-reduce buffers when it closes, and no other
run's: the buffers are named after the ranks' rendezvous (MASTER_ADDR, MASTER_PORT), and a
buffer of another port is removed only when no live process has it open or mapped."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

import psutil
import pytest

from mmrl.utils.env import ALLREDUCE_BUFFER_PREFIX, SHM_DIR, allreduce_buffer_prefix, cleanup_shm

REPO = Path(__file__).resolve().parents[1]

# holds FILE open ("open") or mapped with its descriptor closed ("map") until stdin closes
_HOLD = """
import mmap, os, sys
mode, path = sys.argv[1:]
fd = os.open(path, os.O_RDWR)
if mode == "map":
    held = mmap.mmap(fd, 0)
    os.close(fd)
print("ready", flush=True)
sys.stdin.read()
"""


def _buffer(shm_dir: Path, addr: str, port: int, rank: int, uid: int | None = None) -> Path:
    prefix = allreduce_buffer_prefix(addr, port)
    if uid is not None:
        prefix = f"{ALLREDUCE_BUFFER_PREFIX}_{uid}_{addr}_{port}_"
    path = shm_dir / f"{prefix}{rank}"
    path.write_bytes(b"\0" * 4096)
    return path


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A folder on /dev/shm: the tmpfs where DeepSpeed's buffers live."""
    path = Path(tempfile.mkdtemp(prefix="mmrl-test-shm-", dir=SHM_DIR if SHM_DIR.is_dir() else None))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_only_this_runs_buffers_and_unused_ones_are_removed(shm_dir: Path) -> None:
    this_run = [_buffer(shm_dir, "127.0.0.1", 5000, r) for r in (0, 1)]
    live_port_prefix = _buffer(shm_dir, "127.0.0.1", 50001, 0)  # "..._5000" is a prefix of its port
    live_other_addr = _buffer(shm_dir, "10.0.0.2", 5000, 0)
    orphan = _buffer(shm_dir, "127.0.0.1", 6000, 0)  # its run was killed: nobody holds it
    other_user = _buffer(shm_dir, "127.0.0.1", 6000, 0, uid=os.getuid() + 1)
    unrelated = shm_dir / "mmrl-ring-1-abc"
    unrelated.write_bytes(b"x")
    holders = [subprocess.Popen([sys.executable, "-c", _HOLD, mode, str(path)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
               for mode, path in [("map", live_port_prefix), ("open", live_other_addr), ("map", this_run[1])]]
    try:
        assert [h.stdout.readline().strip() for h in holders] == ["ready"] * 3
        assert cleanup_shm("127.0.0.1", 5000, orphans=False, shm_dir=shm_dir) == [str(p) for p in this_run]
        orphan_too = _buffer(shm_dir, "127.0.0.1", 6000, 1)
        # without a rendezvous (as after a run killed before it could close): only what nobody holds
        assert cleanup_shm(shm_dir=shm_dir) == [str(orphan), str(orphan_too)]
        assert all(p.exists() for p in (live_port_prefix, live_other_addr, other_user, unrelated))
        assert not any(p.exists() for p in this_run)  # this run's: gone, even while still mapped
    finally:
        for h in holders:
            h.stdin.close()
            h.wait(timeout=60)
    # the holders exited: their buffers are orphans now
    assert sorted(cleanup_shm(shm_dir=shm_dir)) == sorted([str(live_port_prefix), str(live_other_addr)])
    assert sorted(p.name for p in shm_dir.iterdir()) == sorted([other_user.name, unrelated.name])


# ---- two real runs side by side --------------------------------------------------------------------------


def _train(run_dir: Path, model: Path, data: Path) -> subprocess.Popen:
    """A demo run that goes on until SIGTERM (the CLI's graceful stop: the run closes as at its end).
    The buffers are the trainer ranks': the ranks sample too (rollout.backend=trainer), so two
    runs start on a 2-core machine without two vLLM engines beside four ranks."""
    cmd = [sys.executable, "-m", "mmrl.cli", "train", str(REPO / "configs" / "colors_demo.yaml"),
           f"model.path={model}", f"data.train_shards={data}/train-{{000000..000001}}.tar",
           f"data.heldout_shards={data}/heldout-000000.tar", f"run.output_dir={run_dir}", "run.max_steps=100000",
           "run.time_limit_s=null", "rollout.backend=trainer", "rollout.prompts_per_step=4", "rollout.group_size=4",
           "eval.every_steps=0",
           "eval.num_prompts=4", "checkpoint.every_steps=0", "stability.enabled=false", "logging.progress_bar=false"]
    # DeepSpeed makes its shm all-reduce buffers only when LOCAL_SIZE equals the world size (as
    # its own launcher sets it); mmrl's ranks do not set it, so it comes from the environment here.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "LOCAL_SIZE": "2"}
    run_dir.mkdir(parents=True)
    log = open(run_dir.parent / f"{run_dir.name}.log", "w")
    return subprocess.Popen(cmd, cwd=run_dir.parent, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def _mapped_buffers(proc: subprocess.Popen) -> set[str]:
    """The all-reduce buffers that the processes of a run (its driver and all under it) map."""
    found: set[str] = set()
    try:
        family = [proc.pid] + [p.pid for p in psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return found
    for pid in family:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
        except OSError:  # exited meanwhile
            continue
        found |= {fields[5] for fields in (line.split(maxsplit=5) for line in maps)
                  if len(fields) == 6 and Path(fields[5]).name.startswith(ALLREDUCE_BUFFER_PREFIX)}
    return found


def _steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return max((json.loads(line)["step"] for line in lines if line.endswith("}")), default=0)


def _wait_for(what: str, ready: Callable[[], bool], runs: dict[str, subprocess.Popen], root: Path, timeout_s: float = 2400) -> None:
    deadline = time.time() + timeout_s
    while not ready():
        for name, proc in runs.items():
            assert proc.poll() is None, f"run {name} ended (rc {proc.returncode}) while waiting for {what}:\n" + \
                (root / f"{name}.log").read_text()[-4000:]
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(1.0)


def _stop(name: str, proc: subprocess.Popen, root: Path) -> None:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=900) == 143, (root / f"{name}.log").read_text()[-4000:]  # the CLI's SIGTERM exit
    log = (root / f"{name}.log").read_text()
    assert "clean shutdown failed" not in log, log[-4000:]


@pytest.mark.slow
@pytest.mark.timeout(3600)  # two runs at once on a busy 2-core machine; the bound is for hangs only
def test_two_concurrent_runs_each_remove_only_their_own_buffers(tiny_model_dir: Path, colors_dir: Path,
                                                                tmp_path: Path) -> None:
    """Two real runs on one machine: each has its own buffers while it trains; stopping the first
    removes its buffers and leaves the second's (which goes on training); stopping the second
    removes its own. A cleanup by name prefix alone removed the second run's buffers."""
    runs = {name: _train(tmp_path / name, tiny_model_dir, colors_dir) for name in ("a", "b")}
    try:
        buffers: dict[str, set[str]] = {}

        def both_training_with_buffers() -> bool:
            for name, proc in runs.items():
                buffers[name] = _mapped_buffers(proc)
            return all(len(buffers[n]) == 2 and _steps(tmp_path / n) >= 1 for n in runs)

        _wait_for("both runs to train with their shm buffers", both_training_with_buffers, runs, tmp_path)
        for name, names in buffers.items():  # ranks 0 and 1 of one process group, named by its rendezvous
            assert {Path(p).parent for p in names} == {SHM_DIR}, names
            assert sorted(p[-2:] for p in names) == ["_0", "_1"] and len({p[:-1] for p in names}) == 1, names
        assert not buffers["a"] & buffers["b"]
        assert all(os.path.exists(p) for p in buffers["a"] | buffers["b"])

        _stop("a", runs["a"], tmp_path)
        assert not any(os.path.exists(p) for p in buffers["a"])
        assert all(os.path.exists(p) for p in buffers["b"])  # the live run's buffers are untouched
        steps_b = _steps(tmp_path / "b")
        _wait_for("run b to go on training", lambda: _steps(tmp_path / "b") >= steps_b + 2, {"b": runs["b"]}, tmp_path)

        _stop("b", runs["b"], tmp_path)
        assert not any(os.path.exists(p) for p in buffers["b"])
    finally:
        for proc in runs.values():  # only on failure: the runs started here, with all their processes
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=60)
