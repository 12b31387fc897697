"""Which actor gets which Ray resources (`mmrl train --dry-run` prints the same plan; pure planning:
no GPU is needed to check the CUDA plan), and the process environment the actors start with."""
from __future__ import annotations

import hashlib
import os
import sys
import time
from pathlib import Path

import pytest

from mmrl.config import load_config
from mmrl.config.load import ConfigError
from mmrl.controller.placement import format_plan, placement_plan
from mmrl.utils.env import remove_stale_build_locks, torch_extensions_dir

DEMO = str(Path(__file__).resolve().parents[1] / "configs" / "colors_demo.yaml")


def test_cpu_plan_of_the_demo() -> None:
    plan = placement_plan(load_config(DEMO, [], check_files=False), "cpu")
    assert [p.role for p in plan] == ["driver", "rollout", "rollout_worker", "reward", "trainer", "trainer"]
    assert all("GPU" not in p.resources for p in plan)
    assert "total Ray resources requested: CPU=2" in format_plan(plan)


def test_reward_workers_can_take_a_gpu_share_on_cuda() -> None:
    cfg = load_config(DEMO, ["reward_execution.num_workers=2", "reward_execution.num_gpus=0.25",
                             "reward_execution.num_cpus=1"], check_files=False)
    rewards = [p for p in placement_plan(cfg, "cuda") if p.role == "reward"]
    assert [p.ray_options() for p in rewards] == [{"num_cpus": 1.0, "num_gpus": 0.25}] * 2
    with pytest.raises(ConfigError, match="reward_execution.num_gpus' is 0.25 but this run has no GPU"):
        placement_plan(cfg, "cpu")


def test_stale_torch_extension_build_locks_are_removed(tmp_path: Path) -> None:
    """A build killed mid-way leaves a lock that torch waits on forever (every later DeepSpeed
    init would hang); a fresh lock (a build in progress) is left alone."""
    stale, fresh = tmp_path / "deepspeed_shm_comm" / "lock", tmp_path / "other_op" / "lock"
    for lock in (stale, fresh):
        lock.parent.mkdir()
        lock.touch()
    old = time.time() - 3600
    os.utime(stale, (old, old))
    with pytest.warns(UserWarning, match="stale torch extension build lock"):
        assert remove_stale_build_locks(tmp_path) == [str(stale)]
    assert not stale.exists() and fresh.exists()


def test_torch_extensions_dir_is_per_python_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    expected = tmp_path / ".cache" / "mmrl" / "torch_extensions" / hashlib.sha1(sys.prefix.encode()).hexdigest()[:10]
    assert torch_extensions_dir() == str(expected)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "mine"))  # the user's choice wins
    assert torch_extensions_dir() == str(tmp_path / "mine")


def test_trainer_backend_plan_has_no_vllm_engine() -> None:
    """rollout.backend=trainer: one sampler actor on the trainer ranks (no CPU of its own), no engines."""
    plan = placement_plan(load_config(DEMO, ["rollout.backend=trainer", "rollout.num_engines=2"], check_files=False), "cpu")
    rollout = [p for p in plan if p.role == "rollout"]
    assert len(rollout) == 1 and rollout[0].resources == {"CPU": 0.0} and "trainer ranks" in rollout[0].work
    assert "weight buckets" not in format_plan(plan)
