"""Exact checkpoints: RUN_DIR/checkpoints/step_000040/

    deepspeed/          DeepSpeed's sharded model + optimizer state (one file per rank)
    rng_rank{r}.pt      each trainer rank's RNG states
    controller.pt       step, weight version, data-stream cursor, controller RNG states, the
                        stability guard's and the learning rate's state, the summary so far
    hf/                 config + tokenizer/processor files of the model (what `mmrl export` needs)
    meta.json           the readable part of controller.pt; written last: its presence marks a
                        complete checkpoint

A checkpoint is written to step_N.partial and renamed when complete, so a run killed while
saving leaves the previous checkpoints intact and never a half one that looks whole.
"""
from __future__ import annotations

import json
import random
import shutil
import time
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import ray
import torch

CHECKPOINT_DIR = "checkpoints"
_PREFIX = "step_"


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR / f"{_PREFIX}{step:06d}"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = Path(run_dir) / CHECKPOINT_DIR
    if not root.is_dir():
        return []
    done = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(_PREFIX) and (p / "meta.json").exists()
            and not p.name.endswith(".partial")]
    return sorted(done, key=lambda p: int(p.name[len(_PREFIX):]))


def latest_checkpoint(run_dir: Path, before_step: int | None = None) -> Path | None:
    """The newest complete checkpoint (optionally: saved before `before_step`)."""
    found = [p for p in list_checkpoints(run_dir) if before_step is None or read_meta(p)["step"] < before_step]
    return found[-1] if found else None


def read_meta(path: Path) -> dict[str, Any]:
    return json.loads((Path(path) / "meta.json").read_text())


def rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


def _copy_model_files(model_path: str, dest: Path, trust_remote_code: bool) -> None:
    """Config and processor files (no weights): export must not depend on the original folder."""
    from transformers import AutoConfig, AutoProcessor

    dest.mkdir(parents=True, exist_ok=True)
    AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code).save_pretrained(dest)
    AutoProcessor.from_pretrained(model_path, trust_remote_code=trust_remote_code).save_pretrained(dest)


def save_checkpoint(run_dir: Path, step: int, trainers: Sequence[Any], controller_state: dict[str, Any], *,
                    model_path: str, trust_remote_code: bool = False, keep_last: int = 2,
                    protect: Path | None = None) -> Path:
    """Write a checkpoint of every rank plus the controller state; prune to `keep_last`
    (never removing `protect`, the stability guard's last good checkpoint)."""
    t0 = time.time()
    final = checkpoint_dir(run_dir, step)
    partial = final.with_name(final.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    ray.get([t.save_checkpoint.remote(str(partial)) for t in trainers])
    _copy_model_files(model_path, partial / "hf", trust_remote_code)
    torch.save({**controller_state, "rng": rng_state()}, partial / "controller.pt")
    meta = {k: v for k, v in controller_state.items() if isinstance(v, (int, float, str, bool)) or v is None}
    meta.update(step=step, model_path=model_path, saved_at=time.strftime("%Y-%m-%d %H:%M:%S"),
                save_s=round(time.time() - t0, 3))
    (partial / "meta.json").write_text(json.dumps(meta, indent=2))
    shutil.rmtree(final, ignore_errors=True)
    partial.rename(final)
    for old in list_checkpoints(run_dir)[:-keep_last] if keep_last > 0 else []:
        if protect is None or old.resolve() != Path(protect).resolve():
            shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(path: Path, trainers: Sequence[Any]) -> dict[str, Any]:
    """Restore every rank from `path`; return the controller state (RNG states already applied)."""
    ray.get([t.load_checkpoint.remote(str(path)) for t in trainers])
    state = torch.load(Path(path) / "controller.pt", weights_only=False)
    set_rng_state(state.pop("rng"))
    return state


def truncate_metrics(run_dir: Path, step: int, name: str = "metrics.jsonl") -> int:
    """Drop step records after `step` (written by a run that died before its next checkpoint),
    so the resumed run's records continue the file without duplicates. Returns lines dropped."""
    path = Path(run_dir) / name
    if not path.exists():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            dropped += 1  # a line cut by the kill
            continue
        if record.get("step", 0) <= step:
            kept.append(line)
        else:
            dropped += 1
    path.write_text("".join(line + "\n" for line in kept))
    return dropped
