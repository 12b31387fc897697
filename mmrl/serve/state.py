"""Training state checkpoints (`save_state` / `load_state`): a LoRA adapter and its AdamW state.

A state checkpoint is a folder under `serve.store_dir/checkpoints/<model_id>/weights/`:
- `adapter.safetensors`: the trainable LoRA tensors (peft names), exactly as trained;
- `optimizer.safetensors`: AdamW's per-parameter state (`<param name>::step|exp_avg|exp_avg_sq`),
  absent when no optim_step ran yet;
- `meta.json`: the base model, the LoRA config, the step count and the optimizer's hyperparameters.
Tensors are keyed by parameter name, not by the optimizer's positional ids or ZeRO-3 partitions, so
a checkpoint loads into any trainer with the same adapter layout, either kind (`serve.trainer`
local or deepspeed), and says which tensor differs when it does not.

Writes are atomic: the folder is written under a `.tmp-<server id>.<token>` name, renamed to a name
no earlier save used, and only then recorded in the store; a kill leaves a `.tmp-` folder or an
unlisted folder, never a listed half checkpoint. A server starting sweeps the `.tmp-` folders of
servers that died (`sweep_partial`), not those of live servers sharing the store.
"""
from __future__ import annotations

import json
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mmrl.serve.trainer import UserInputError, check_adapter_layout

TINKER = "tinker://"
# the path segment of each checkpoint kind, and the store's name for that kind
SEGMENT_KIND = {"weights": "state", "sampler_weights": "sampler"}
SDK_TYPE = {"state": "training", "sampler": "sampler"}  # Checkpoint.checkpoint_type
FORMAT = 1
TMP_PREFIX = ".tmp-"
# A dead server's `.tmp-` folder is swept only once nothing in it changed for this long. The server
# id in the name is the real test; this bound guards a live server taken for dead (no heartbeat for
# the store's STALE_S, e.g. the database unreachable) while it writes a large checkpoint, and
# mtimes set by a shared filesystem's clock. A leftover only costs disk space until a later start.
SWEEP_MIN_AGE_S = 600.0


@dataclass(frozen=True)
class CheckpointPath:
    path: str
    model_id: str
    kind: str  # state | sampler
    name: str

    @property
    def checkpoint_id(self) -> str:
        return self.path.split("/", 3)[3]


def parse_path(path: Any, field: str = "path") -> CheckpointPath:
    """`tinker://<model_id>/weights/<name>` or `.../sampler_weights/<name>`; anything else is a 400
    naming the path."""
    parts = path[len(TINKER):].split("/") if isinstance(path, str) and path.startswith(TINKER) else []
    if len(parts) != 3 or not all(parts) or parts[1] not in SEGMENT_KIND:
        raise UserInputError(f"{field} {path!r} is not a checkpoint path: expected "
                             f"tinker://<training_run_id>/weights/<name> (or /sampler_weights/<name>)", field)
    return CheckpointPath(path, parts[0], SEGMENT_KIND[parts[1]], parts[2])


def check_name(name: Any) -> str:
    if not isinstance(name, str) or not name:
        raise UserInputError("path (the checkpoint name) is required", "path")
    if "/" in name or name.startswith("."):
        raise UserInputError(f"path {name!r}: a checkpoint name may not contain '/' or start with '.'", "path")
    return name


def write_state(trainer: Any, root: Path, name: str, meta: dict[str, Any],
                server_id: str | None = None) -> tuple[Path, int]:
    """Write the trainer's state as a new folder under `root`; (the folder, its size in bytes).
    `server_id` (the writing server's) goes into the `.tmp-` name, for `sweep_partial`."""
    from safetensors.torch import save_file

    root.mkdir(parents=True, exist_ok=True)
    token = uuid.uuid4().hex[:12]
    tmp = root / (f"{TMP_PREFIX}{server_id}.{token}" if server_id else f"{TMP_PREFIX}{token}")
    tmp.mkdir()
    try:
        save_file(trainer.adapter_state(), str(tmp / "adapter.safetensors"))
        opt, hyper = trainer.optimizer_state()
        if opt:
            save_file(opt, str(tmp / "optimizer.safetensors"))
        full = {**meta, "format": FORMAT, "steps": trainer.steps, "optimizer": hyper}
        (tmp / "meta.json").write_text(json.dumps(full, indent=1))
        final = root / f"{name}.{token}"
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final, sum(f.stat().st_size for f in final.iterdir())


def tmp_server(folder: Path) -> str | None:
    """The server id in a `.tmp-<server id>.<token>` name; None for a name from before server ids."""
    rest = folder.name[len(TMP_PREFIX):]
    return rest.rsplit(".", 1)[0] if "." in rest else None


def last_change(folder: Path) -> float:
    """The newest mtime of the folder and its files (a file being written keeps it fresh)."""
    return max([folder.stat().st_mtime, *(f.stat().st_mtime for f in folder.iterdir())])


def abandoned(folder: Path, live_servers: set[str], now: float) -> bool:
    """A `.tmp-` folder no live server is writing: its server is not live and it has not changed
    for SWEEP_MIN_AGE_S. A name without a server id was written by a server from before server ids
    (one store is not shared with those), so it is abandoned."""
    server = tmp_server(folder)
    if server is None:
        return True
    if server in live_servers:
        return False
    try:
        return now - last_change(folder) >= SWEEP_MIN_AGE_S
    except FileNotFoundError:  # renamed or removed meanwhile: nothing to sweep
        return False


def sweep_partial(checkpoints_dir: Path, live_servers: set[str], now: float | None = None) -> int:
    """Remove the `.tmp-` folders that saves of dead servers left behind (`abandoned`); how many."""
    now = time.time() if now is None else now
    found = list(checkpoints_dir.glob(f"*/weights/{TMP_PREFIX}*")) if checkpoints_dir.is_dir() else []
    gone = [folder for folder in found if abandoned(folder, live_servers, now)]
    for folder in gone:
        shutil.rmtree(folder, ignore_errors=True)
    return len(gone)


def remove_files(file: str) -> None:
    """Delete a checkpoint's files: a state folder or a sampler safetensors file."""
    p = Path(file)
    if p.is_dir():
        shutil.rmtree(p, ignore_errors=True)
    else:
        p.unlink(missing_ok=True)


# ---- load -----------------------------------------------------------------------------------------
def read_meta(folder: str | Path) -> dict[str, Any]:
    return json.loads((Path(folder) / "meta.json").read_text())


def load_state(trainer: Any, folder: str | Path, path: str, with_optimizer: bool) -> None:
    """Load a state folder into `trainer` (either trainer kind: the files name tensors, not ranks or
    optimizer slots): the adapter always; AdamW's moments and step count when `with_optimizer`,
    else a fresh optimizer (the next optim_step starts Adam anew). Gradients accumulated before the
    load are dropped: they belong to the replaced weights."""
    from safetensors.torch import load_file

    folder = Path(folder)
    meta = read_meta(folder)
    saved = load_file(str(folder / "adapter.safetensors"))
    check_adapter_layout(trainer.adapter_shapes(), saved, path)
    trainer.load_adapter(saved)
    if with_optimizer and meta.get("optimizer") is not None:
        trainer.load_optimizer(load_file(str(folder / "optimizer.safetensors")), meta["optimizer"])
    else:
        trainer.load_optimizer(None, None)
    trainer.steps = int(meta.get("steps", 0)) if with_optimizer else 0
