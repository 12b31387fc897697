"""Shared fixtures: the tiny model and the colours shards are built once per session, locally."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mmrl.models.tiny_vlm import build_tiny_vlm

    return build_tiny_vlm("qwen2_5_vl", tmp_path_factory.mktemp("tiny") / "qwen2_5_vl", seed=0)


@pytest.fixture(scope="session")
def tiny_llava_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mmrl.models.tiny_vlm import build_tiny_vlm

    return build_tiny_vlm("llava", tmp_path_factory.mktemp("tiny") / "llava", seed=0)


@pytest.fixture(scope="session")
def tiny_internvl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mmrl.models.tiny_vlm import build_tiny_vlm

    return build_tiny_vlm("internvl", tmp_path_factory.mktemp("tiny") / "internvl", seed=0)


@pytest.fixture(scope="session")
def colors_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mmrl.plugins.data.recipes.colors import build

    out = tmp_path_factory.mktemp("colors")
    build(out, train_size=1024, heldout_size=64, shard_size=512, seed=0)
    return out


@pytest.fixture(scope="session")
def colors_samples(colors_dir: Path) -> list:
    from mmrl.data.stream import load_all

    return load_all(str(colors_dir / "heldout-000000.tar"))


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, colors_dir: Path) -> Path:
    """One uninterrupted 40-step run of `_runs.kill_test_cmd`: the kill/resume tests
    (test_restarts.py) compare their runs with it step by step, test_export.py exports it."""
    from _runs import kill_test_cmd, run_to_end

    root = tmp_path_factory.mktemp("reference")
    run = root / "run"
    run_to_end(kill_test_cmd(run, tiny_model_dir, colors_dir, 40), root)
    return run


@pytest.fixture(autouse=True, scope="module")
def _ray_shut_down_after_module():
    """A module fixture that fails after starting Ray never reaches its teardown; without this, every
    later module that starts Ray fails too ("called ray.init twice") and one error becomes many."""
    yield
    import sys

    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


EXIT_GRACE_S = 300  # far more than a clean exit takes (Ray sessions are shut down per module above)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A thread stuck in a test's leftover (a server's start that hung) is joined forever when the
    interpreter exits, and the suite then runs into CI's time limit with its results unreported.
    A daemon watchdog ends such a process instead: every thread's stack (naming the stuck one),
    then exit status 1 (or the session's own failure status). A clean exit ends it unfired."""
    import faulthandler
    import sys
    import threading
    import time

    def exit_anyway() -> None:
        time.sleep(EXIT_GRACE_S)
        print(f"\n[tests] the test process has not exited {EXIT_GRACE_S} s after the session ended; "
              "a thread below is stuck:", file=sys.__stderr__, flush=True)
        faulthandler.dump_traceback(file=sys.__stderr__, all_threads=True)
        os._exit(int(exitstatus) or 1)

    threading.Thread(target=exit_anyway, name="exit-watchdog", daemon=True).start()
