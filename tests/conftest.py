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
