"""init_local_ray on a busy machine: Ray 2.60 gives a new node a fixed 30 s to register, and a
loaded 2-core machine can miss it (seen in CI with two busy loops and a training run beside it).
The failed start's orphaned processes are stopped and the start is retried; any other error is
raised at once. Worker processes get 600 s to register instead of 60 (seen too: a reward worker
killed and restarted five times, then the actor given up). Ray itself is replaced here by a stand-in that fails like Ray does, because a
real raylet cannot be made slow on demand; the orphan is a real process that must be killed."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from mmrl.utils import env as env_mod

TIMEOUT_MESSAGE = ("The current node timed out during startup. This could happen because some of the raylet "
                   "failed to startup or the GCS has become overloaded.")


class _FlakyRay:
    """ray.init that fails `failures` times the way Ray 2.60 does, leaving a session folder and a
    process named after it behind each time."""

    def __init__(self, tmp: Path, failures: int, error: str = TIMEOUT_MESSAGE):
        self.tmp, self.failures, self.error = tmp, failures, error
        self.calls: list[dict] = []
        self.orphans: list[subprocess.Popen] = []

    def init(self, **kwargs) -> None:
        self.calls.append(kwargs)
        if len(self.calls) > self.failures:
            return
        name = f"session_2026-12-03_00-00-0{len(self.calls)}_000000_{id(self)}"
        (self.tmp / name).mkdir()
        self.orphans.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)",
                                              f"--session_name={name}"]))
        raise Exception(self.error)


@pytest.fixture
def flaky(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))

    def make(failures: int, error: str = TIMEOUT_MESSAGE) -> _FlakyRay:
        stand_in = _FlakyRay(tmp_path, failures, error)
        monkeypatch.setattr("ray.init", stand_in.init)
        return stand_in

    yield make


def test_a_start_that_times_out_is_cleaned_up_and_retried(flaky, capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_worker_register_timeout_seconds", raising=False)
    ray = flaky(failures=2)
    env_mod.init_local_ray(num_cpus=2, include_dashboard=False)
    assert ray.calls == [{"num_cpus": 2, "include_dashboard": False}] * 3
    for orphan in ray.orphans:  # the failed starts' processes are gone (SIGKILL), not left running
        assert orphan.wait(timeout=30) == -9
    err = capsys.readouterr().err
    assert "retrying (1/2)" in err and "retrying (2/2)" in err and "stopped the 1 process(es)" in err
    # slow worker start-up is waited for (the raylet reads this when it starts), not killed at 60 s
    assert os.environ["RAY_worker_register_timeout_seconds"] == str(env_mod.RAY_WORKER_REGISTER_TIMEOUT_S)


def test_the_last_timeout_and_any_other_error_are_raised(flaky) -> None:
    ray = flaky(failures=env_mod.RAY_START_ATTEMPTS)
    with pytest.raises(Exception, match="timed out during startup"):
        env_mod.init_local_ray(num_cpus=2)
    assert len(ray.calls) == env_mod.RAY_START_ATTEMPTS
    for orphan in ray.orphans[:-1]:
        assert orphan.wait(timeout=30) == -9
    ray.orphans[-1].kill()

    ray = flaky(failures=1, error="ray.init() got an unexpected keyword argument 'num_cpu'")
    with pytest.raises(Exception, match="unexpected keyword"):
        env_mod.init_local_ray(num_cpu=2)
    assert len(ray.calls) == 1  # not a start-up timeout: no retry
    ray.orphans[0].kill()
