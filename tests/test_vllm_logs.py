"""vLLM's known-harmless warnings are dropped; a warning that names a real problem still shows."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from mmrl.rollout import vllm_logs
from mmrl.rollout.vllm_logs import QUIET, RELOAD_FAILED, RELOAD_LOGGER, VllmNoiseFilter, mark_config_only_modules

REPO = Path(__file__).resolve().parents[1]


def _record(logger: str, msg: str, *args: object, level: int = logging.WARNING) -> logging.LogRecord:
    return logging.LogRecord(logger, level, __file__, 1, msg, args, None)


@pytest.fixture(autouse=True)
def _fresh_marks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm_logs, "_config_only_classes", set())


@pytest.fixture(scope="module")
def served_like_model() -> torch.nn.Module:
    """The modules that warn on every weight sync of the tiny Qwen2.5-VL (real vLLM classes), next
    to a module with parameters."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.fusion.mm_input_norm import FusedMMInputNorm
    from vllm.model_executor.layers.rotary_embedding import get_rope

    with set_current_vllm_config(VllmConfig()):
        rope = get_rope(64, 512, is_neox_style=True, dtype=torch.float32,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        mrope = get_rope(64, 512, is_neox_style=True, dtype=torch.float32,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [16, 8, 8]})
        norm = FusedMMInputNorm([0.48, 0.46, 0.41], [0.27, 0.26, 0.28], 1 / 255)
    return torch.nn.ModuleDict({"rope": rope, "mrope": mrope, "input_norm": norm, "proj": torch.nn.Linear(4, 4)})


def test_config_only_modules_are_marked_and_their_reload_warning_dropped(served_like_model: torch.nn.Module) -> None:
    marked = mark_config_only_modules(served_like_model)
    assert marked == {"RotaryEmbedding", "MRotaryEmbedding", "FusedMMInputNorm"}
    for module in served_like_model.values():
        if type(module).__name__ in marked:  # what makes the warning harmless: nothing to load
            assert not list(module.parameters()) and list(module.buffers())
    f = VllmNoiseFilter()
    for name in marked:
        assert not f.filter(_record(RELOAD_LOGGER, RELOAD_FAILED, name))


def test_a_reload_failure_of_a_module_with_parameters_still_shows(served_like_model: torch.nn.Module) -> None:
    mark_config_only_modules(served_like_model)
    f = VllmNoiseFilter()
    assert f.filter(_record(RELOAD_LOGGER, RELOAD_FAILED, "Linear"))
    assert f.filter(_record(RELOAD_LOGGER, RELOAD_FAILED, "QKVParallelLinear"))
    # other messages of the same logger, and the reload's own list of unloaded weights
    assert f.filter(_record(RELOAD_LOGGER, "Allocating %.1f MB of device memory to buffers to load %s layers.",
                            1.0, "[]"))
    unloaded = {"visual.blocks.0.attn.qkv.weight"}
    assert f.filter(_record("vllm.model_executor.model_loader.reload.inplace",
                            "Following weights were not loaded from checkpoint: %s", unloaded))


def test_nothing_is_dropped_before_the_model_is_marked() -> None:
    assert VllmNoiseFilter().filter(_record(RELOAD_LOGGER, RELOAD_FAILED, "RotaryEmbedding"))


def test_a_class_name_that_also_names_a_module_with_parameters_stays_loud(served_like_model: torch.nn.Module) -> None:
    class RotaryEmbedding(torch.nn.Module):  # e.g. a remote-code model's learned rotary
        def __init__(self) -> None:
            super().__init__()
            self.scale = torch.nn.Parameter(torch.ones(2))

    model = torch.nn.ModuleDict({**served_like_model, "learned": RotaryEmbedding()})
    assert "RotaryEmbedding" not in mark_config_only_modules(model)
    assert VllmNoiseFilter().filter(_record(RELOAD_LOGGER, RELOAD_FAILED, "RotaryEmbedding"))


def test_each_quiet_message_is_dropped_only_on_its_logger_and_only_up_to_warning() -> None:
    f = VllmNoiseFilter()
    for logger, prefix in QUIET:
        msg = prefix + " (rest of the message)"
        assert not f.filter(_record(logger, msg)), (logger, prefix)
        assert f.filter(_record(logger, msg, level=logging.ERROR)), (logger, prefix)
        assert f.filter(_record("vllm.somewhere.else", msg)), (logger, prefix)
        assert f.filter(_record(logger, "Some other warning from the same place")), logger


# What vLLM's engine core and worker do when they start (spawned, with the actor's environment):
# configure vLLM's logging from the environment, then log and warn.
_CHILD = textwrap.dedent("""
    import logging, warnings
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging
    configure_logging(LoggingConfig())
    logging.getLogger("vllm.config.vllm").warning("Enforce eager set, disabling torch.compile (harmless)")
    logging.getLogger("vllm.config.vllm").warning("a real problem in the config")
    logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").warning(
        "%s: Failed to load weights", "QKVParallelLinear")
    warnings.warn("`torch.distributed.reduce_op` is deprecated, please use ReduceOp", FutureWarning)
    warnings.warn("another deprecation", FutureWarning)
""")
_PARENT = textwrap.dedent("""
    import os, subprocess, sys
    from mmrl.rollout.vllm_logs import configure_engine_logging
    print("config", configure_engine_logging(sys.argv[1]), flush=True)
    sys.exit(subprocess.run([sys.executable, "-c", sys.argv[2]]).returncode)
""")


def test_spawned_engine_processes_get_the_filter_through_the_environment(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_LOGGING_CONFIG_PATH", "PYTHONWARNINGS")}
    env["VLLM_LOGGING_LEVEL"] = "WARNING"
    out = subprocess.run([sys.executable, "-c", _PARENT, str(tmp_path), _CHILD], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout + out.stderr
    assert f"config {tmp_path / 'mmrl_vllm_logging.json'}" in text
    assert "a real problem in the config" in text and "WARNING" in text  # vLLM's own format
    assert "QKVParallelLinear: Failed to load weights" in text
    assert "another deprecation" in text
    assert "Enforce eager set" not in text and "reduce_op" not in text


def test_a_users_own_logging_config_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mine = tmp_path / "mine.json"
    monkeypatch.setenv("VLLM_LOGGING_CONFIG_PATH", str(mine))
    monkeypatch.setenv("PYTHONWARNINGS", "default")
    monkeypatch.setattr(logging.getLogger("vllm.triton_utils.importing"), "filters", [])
    assert vllm_logs.configure_engine_logging(tmp_path) is None
    assert os.environ["VLLM_LOGGING_CONFIG_PATH"] == str(mine)
    assert os.environ["PYTHONWARNINGS"].startswith("default,ignore:`torch.distributed.reduce_op` is deprecated")


def test_a_later_engine_in_the_same_process_gets_its_own_config(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("VLLM_LOGGING_CONFIG_PATH", "PYTHONWARNINGS"):  # recorded, so restored afterwards
        monkeypatch.setenv(key, "")
        monkeypatch.delenv(key)
    monkeypatch.setattr(vllm_logs, "_written_configs", set())
    monkeypatch.setattr(logging.getLogger("vllm.triton_utils.importing"), "filters", [])
    first = vllm_logs.configure_engine_logging(tmp_path / "a")
    second = vllm_logs.configure_engine_logging(tmp_path / "b")  # e.g. the first run dir is gone by now
    assert second == str(tmp_path / "b" / "mmrl_vllm_logging.json") != first
    assert os.environ["VLLM_LOGGING_CONFIG_PATH"] == second and Path(second).is_file()
    assert os.environ["PYTHONWARNINGS"].count("reduce_op") == 1
