"""vLLM's records of model classes (`VLLM_CACHE_ROOT/modelinfos`), shared between runs.

Before an engine starts, vLLM needs a few facts about the model class (multimodal? MoE? ...).
Without a record it finds them in a fresh interpreter that imports vLLM and the model module:
measured here, the tiny demo engine's start went from 17.5 s to 28.8 s on an idle 2-core machine
(more under load, and once per run, since each run has its own `VLLM_CACHE_ROOT`). A record
carries the hash of the model's source file (vLLM ignores a stale one) and is small, so the
records are copied between the run's cache and one folder per Python environment: into the run
before the engine starts, back once it is up. Copies are written atomically (other runs may
read the folder at the same time); a cache that cannot be read or written only costs time.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from mmrl.utils.env import environment_cache_dir

FOLDER = "modelinfos"  # vLLM's name, under VLLM_CACHE_ROOT


def shared_dir() -> Path:
    return environment_cache_dir("vllm_modelinfos")


def _copy_new(src: Path, dst: Path) -> list[str]:
    """Copy the records in `src` that `dst` lacks or holds in another version; returns their names."""
    copied = []
    try:
        records = sorted(src.glob("*.json"))
    except OSError:
        return copied
    for record in records:
        target = dst / record.name
        try:
            data = record.read_bytes()
            if target.exists() and target.read_bytes() == data:
                continue
            dst.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=dst, prefix=f".{record.name}.")
            with os.fdopen(fd, "wb") as out:
                out.write(data)
            os.replace(tmp, target)
            copied.append(record.name)
        except OSError:
            continue
    return copied


def seed_run_cache(cache_root: str | os.PathLike, shared: Path | None = None) -> list[str]:
    """Before the engine starts: the shared records into the run's `cache_root/modelinfos`."""
    return _copy_new(shared or shared_dir(), Path(cache_root) / FOLDER)


def keep_run_cache(cache_root: str | os.PathLike, shared: Path | None = None) -> list[str]:
    """Once the engine is up: what vLLM recorded in the run into the shared folder."""
    return _copy_new(Path(cache_root) / FOLDER, shared or shared_dir())
