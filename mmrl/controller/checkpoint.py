"""Exact checkpoints: RUN_DIR/checkpoints/step_000040/

    deepspeed/          DeepSpeed's sharded model + optimizer state (one file per rank)
    rng_rank{r}.pt      each trainer rank's RNG states
    controller.pt       step, weight version, data-stream cursor, controller RNG states, the
                        stability guard's and the learning rate's state, the summary so far
    hf/                 config + tokenizer/processor files of the model (what `mmrl export` needs)
    meta.json           the readable part of controller.pt; written last: its presence marks a
                        complete checkpoint

A checkpoint is written to step_N.partial, flushed to disk (fsync of every file and folder),
and renamed when complete, so a run killed (or a machine losing power) while saving leaves the
previous checkpoints intact and never a half one that looks whole. A same-step checkpoint being
replaced is set aside as step_N.old first, and a pruned one loses its meta.json first: at every
instant the listed checkpoints are whole. remove_leftovers() tidies what a kill left mid-way.
"""
from __future__ import annotations

import json
import os
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
PARTIAL_SUFFIX = ".partial"  # being written
REPLACED_SUFFIX = ".old"  # a same-step checkpoint set aside while its replacement is renamed in


def _step_of(name: str) -> int | None:
    """N for a folder named exactly step_N (not step_N.partial, step_N.old)."""
    digits = name[len(_PREFIX):]
    return int(digits) if name.startswith(_PREFIX) and digits.isdigit() else None


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR / f"{_PREFIX}{step:06d}"


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = Path(run_dir) / CHECKPOINT_DIR
    if not root.is_dir():
        return []
    done = [p for p in root.iterdir() if p.is_dir() and _step_of(p.name) is not None and (p / "meta.json").exists()]
    return sorted(done, key=lambda p: _step_of(p.name))


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


def fsync_path(path: Path) -> None:
    """Flush one file's or folder's data (a folder: its entries) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and folder under `root` (and `root`), deepest first. fsync flushes the
    file, whichever process wrote it: the ranks' files (written by DeepSpeed in the trainer
    actors) are flushed from the driver too, as ranks and driver write to the same filesystem
    (the one the checkpoint is loaded from)."""
    for folder, _, files in os.walk(root, topdown=False):
        for name in files:
            fsync_path(Path(folder) / name)
        fsync_path(Path(folder))


def _remove_checkpoint(path: Path) -> None:
    """Delete a checkpoint so that no instant lists it half-deleted: meta.json (what makes it
    count) goes first; the rest, if a kill interrupts, is a leftover for remove_leftovers()."""
    (path / "meta.json").unlink(missing_ok=True)
    shutil.rmtree(path, ignore_errors=True)


def remove_leftovers(run_dir: Path) -> list[str]:
    """Tidy what a run killed while saving or pruning left in RUN_DIR/checkpoints, before a
    resume: step_N.partial (unfinished), step_N folders without meta.json (an interrupted
    prune), and step_N.old (the same-step checkpoint that a save set aside: deleted, or renamed
    back when the kill came before its replacement took the name). Returns what it did."""
    root = Path(run_dir) / CHECKPOINT_DIR
    if not root.is_dir():
        return []
    done = []
    for path in sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(_PREFIX)):
        complete = (path / "meta.json").exists()
        original = path.with_name(path.name.removesuffix(REPLACED_SUFFIX))
        if path.name.endswith(REPLACED_SUFFIX) and complete and not original.exists():
            path.rename(original)
            fsync_path(root)
            done.append(f"restored {original.name}")
        elif path.name.endswith((PARTIAL_SUFFIX, REPLACED_SUFFIX)) or (_step_of(path.name) is not None and not complete):
            shutil.rmtree(path, ignore_errors=True)
            done.append(f"removed {path.name}")
    return done


def save_checkpoint(run_dir: Path, step: int, trainers: Sequence[Any], controller_state: dict[str, Any], *,
                    model_path: str, trust_remote_code: bool = False, keep_last: int = 2,
                    protect: Path | None = None) -> Path:
    """Write a checkpoint of every rank plus the controller state; prune to `keep_last`
    (never removing `protect`, the stability guard's last good checkpoint)."""
    t0 = time.time()
    final = checkpoint_dir(run_dir, step)
    partial = final.with_name(final.name + PARTIAL_SUFFIX)
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    ray.get([t.save_checkpoint.remote(str(partial)) for t in trainers])
    _copy_model_files(model_path, partial / "hf", trust_remote_code)
    torch.save({**controller_state, "rng": rng_state()}, partial / "controller.pt")
    meta = {k: v for k, v in controller_state.items() if isinstance(v, (int, float, str, bool)) or v is None}
    meta.update(step=step, model_path=model_path, saved_at=time.strftime("%Y-%m-%d %H:%M:%S"),
                save_s=round(time.time() - t0, 3))
    (partial / "meta.json").write_text(json.dumps(meta, indent=2))
    fsync_tree(partial)  # everything on disk before the name says "complete"
    replaced = final.with_name(final.name + REPLACED_SUFFIX)
    if final.exists():  # a same-step checkpoint (saved again after a rollback): set aside, not deleted yet
        shutil.rmtree(replaced, ignore_errors=True)
        final.rename(replaced)
    partial.rename(final)
    fsync_path(final.parent)  # the rename itself
    fsync_path(final.parent.parent)  # the run dir: checkpoints/ may be new
    shutil.rmtree(replaced, ignore_errors=True)
    for old in list_checkpoints(run_dir)[:-keep_last] if keep_last > 0 else []:
        if protect is None or old.resolve() != Path(protect).resolve():
            _remove_checkpoint(old)
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
