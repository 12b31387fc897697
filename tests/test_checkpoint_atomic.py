"""Checkpoints survive a save that fails half-way: the previous checkpoint stays listed and
loadable, no half checkpoint is ever listed, the next save works and prunes, every file and
folder reaches the disk (fsync) before the rename that makes the checkpoint count, and a resume
tidies what an interrupted save or prune left behind.

The trainer ranks are stand-ins here, and only they: real ranks are DeepSpeed ZeRO-3 engines in
Ray actors (minutes to start on a 2-core machine), and what this file checks is the driver's
part of a save (the partial folder, fsync, renames, pruning, the leftovers). A stand-in writes
its shard and RNG files into the checkpoint folder as TrainerWorker.save_checkpoint does (or
fails part-way), and reads them back on load; its `.remote` runs the call at once, so `ray.get`
is made the identity. The real ranks' save and load are checked end to end by
tests/test_restarts.py (slow: kills and resumes of real runs)."""
from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any, Callable

import pytest
import ray
import torch

from mmrl.controller.checkpoint import (checkpoint_dir, latest_checkpoint, list_checkpoints, load_checkpoint,
                                        remove_leftovers, save_checkpoint)


class _Method:
    """`handle.method.remote(...)` of a Ray actor handle, run at once."""

    def __init__(self, fn: Callable[..., Any]):
        self.remote = fn


class StandInRank:
    """A trainer rank's handle that writes (and reads back) a shard whose values say which step
    it was saved at. `fail_save`: write half the shard, then raise, like a rank that died."""

    def __init__(self, rank: int):
        self.rank, self.weights, self.fail_save, self.loaded = rank, torch.zeros(4), False, None
        self.save_checkpoint, self.load_checkpoint = _Method(self._save), _Method(self._load)

    def _shard(self, path: str) -> Path:
        return Path(path) / "deepspeed" / f"zero_pp_rank_{self.rank}_mp_rank_00_model_states.pt"

    def _save(self, path: str) -> None:
        self._shard(path).parent.mkdir(exist_ok=True)
        if self.fail_save:
            self._shard(path).write_bytes(b"half a shard")
            raise RuntimeError(f"rank {self.rank} died while saving")
        torch.save({"weights": self.weights.clone()}, self._shard(path))
        torch.save({"torch": torch.get_rng_state()}, Path(path) / f"rng_rank{self.rank}.pt")

    def _load(self, path: str) -> None:
        self.loaded = torch.load(self._shard(path))["weights"]
        torch.load(Path(path) / f"rng_rank{self.rank}.pt")


@pytest.fixture
def ranks(monkeypatch: pytest.MonkeyPatch) -> list[StandInRank]:
    monkeypatch.setattr(ray, "get", lambda values, **_: values)  # the stand-ins return their results directly
    return [StandInRank(0), StandInRank(1)]


def _save(run_dir: Path, step: int, ranks: list[StandInRank], model: Path, **kwargs: Any) -> Path:
    for r in ranks:
        r.weights = torch.full((4,), float(step))
    state = {"step": step, "weight_version": step, "data": {"cursor": step * 8}}
    return save_checkpoint(run_dir, step, ranks, state, model_path=str(model), keep_last=2, **kwargs)


def _assert_loads_as(path: Path, ranks: list[StandInRank], step: int) -> None:
    state = load_checkpoint(path, ranks)
    assert state["step"] == step and state["data"] == {"cursor": step * 8}
    assert all(torch.equal(r.loaded, torch.full((4,), float(step))) for r in ranks)


def _names(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


@pytest.mark.parametrize("failure", ["rank_save_raises", "controller_pt_enospc"])
def test_a_failed_save_keeps_the_previous_checkpoint(failure: str, ranks: list[StandInRank], tiny_model_dir: Path,
                                                     tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _save(tmp_path, 2, ranks, tiny_model_dir)
    _save(tmp_path, 4, ranks, tiny_model_dir)
    with monkeypatch.context() as patch:
        if failure == "rank_save_raises":
            ranks[1].fail_save = True
            expected: type[Exception] = RuntimeError
        else:
            real_save = torch.save

            def save_until_the_disk_is_full(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
                if Path(f).name == "controller.pt":
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(f))
                real_save(obj, f, *args, **kwargs)

            patch.setattr(torch, "save", save_until_the_disk_is_full)
            expected = OSError
        with pytest.raises(expected):
            _save(tmp_path, 6, ranks, tiny_model_dir)
    ranks[1].fail_save = False

    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000002", "step_000004"]  # no half step 6
    assert latest_checkpoint(tmp_path) == checkpoint_dir(tmp_path, 4)
    _assert_loads_as(latest_checkpoint(tmp_path), ranks, 4)
    assert "step_000006.partial" in _names(tmp_path)
    assert remove_leftovers(tmp_path) == ["removed step_000006.partial"]  # what a resume does first

    _save(tmp_path, 6, ranks, tiny_model_dir)  # the next save works and prunes to keep_last=2
    assert _names(tmp_path) == ["step_000004", "step_000006"]
    _assert_loads_as(latest_checkpoint(tmp_path), ranks, 6)


def test_replacing_a_same_step_checkpoint_never_loses_it(ranks: list[StandInRank], tiny_model_dir: Path,
                                                         tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A rollback saves step N again over the old step N. Killed between setting the old one
    aside and renaming the new one in, the old one comes back on resume."""
    _save(tmp_path, 2, ranks, tiny_model_dir)
    _save(tmp_path, 4, ranks, tiny_model_dir)
    real_rename = os.rename

    def rename_fails_for_the_new_checkpoint(src: Any, dst: Any) -> None:
        if str(src).endswith(".partial"):
            raise OSError(errno.EIO, "killed here")
        real_rename(src, dst)

    with monkeypatch.context() as patch:
        patch.setattr(os, "rename", rename_fails_for_the_new_checkpoint)
        with pytest.raises(OSError):
            save_checkpoint(tmp_path, 4, ranks, {"step": 4, "weight_version": 99, "data": {"cursor": 0}},
                            model_path=str(tiny_model_dir))
    assert _names(tmp_path) == ["step_000002", "step_000004.old", "step_000004.partial"]
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000002"]  # nothing half-made is listed

    assert remove_leftovers(tmp_path) == ["restored step_000004", "removed step_000004.partial"]
    assert _names(tmp_path) == ["step_000002", "step_000004"]
    _assert_loads_as(latest_checkpoint(tmp_path), ranks, 4)  # the old step 4, whole
    assert json.loads((checkpoint_dir(tmp_path, 4) / "meta.json").read_text())["weight_version"] == 4

    save_checkpoint(tmp_path, 4, ranks, {"step": 4, "weight_version": 99, "data": {"cursor": 32}},
                    model_path=str(tiny_model_dir))  # the same-step save, uninterrupted
    assert _names(tmp_path) == ["step_000002", "step_000004"]
    assert json.loads((checkpoint_dir(tmp_path, 4) / "meta.json").read_text())["weight_version"] == 99


def test_leftovers_are_removed_and_complete_checkpoints_kept(tmp_path: Path) -> None:
    def folder(name: str, complete: bool) -> None:
        (tmp_path / "checkpoints" / name / "deepspeed").mkdir(parents=True)
        if complete:
            (tmp_path / "checkpoints" / name / "meta.json").write_text("{}")

    folder("step_000002", complete=True)
    folder("step_000004", complete=False)  # a prune interrupted after meta.json went
    folder("step_000006", complete=True)
    folder("step_000006.old", complete=True)  # replaced, its replacement already in place
    folder("step_000008.partial", complete=True)  # meta.json written, killed before the rename
    folder("step_000010.old", complete=True)  # set aside, killed before step 10's replacement came in
    assert remove_leftovers(tmp_path) == ["removed step_000004", "removed step_000006.old",
                                          "removed step_000008.partial", "restored step_000010"]
    assert _names(tmp_path) == ["step_000002", "step_000006", "step_000010"]
    assert remove_leftovers(tmp_path) == []
    assert remove_leftovers(tmp_path / "no-such-run") == []


def test_everything_is_fsynced_before_the_rename_and_the_rename_after(
        ranks: list[StandInRank], tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[tuple[str, str]] = []
    real_fsync, real_rename = os.fsync, os.rename

    def recording_fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def recording_rename(src: Any, dst: Any) -> None:
        events.append(("rename", str(src)))
        real_rename(src, dst)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    monkeypatch.setattr(os, "rename", recording_rename)
    final = _save(tmp_path.resolve(), 2, ranks, tiny_model_dir)
    partial = final.with_name(final.name + ".partial")

    renamed_at = events.index(("rename", str(partial)))
    synced_before = {Path(p).relative_to(partial) for kind, p in events[:renamed_at]
                     if kind == "fsync" and Path(p).is_relative_to(partial)}
    on_disk = {p.relative_to(final) for p in final.rglob("*")} | {Path(".")}
    assert on_disk == synced_before  # every file (the ranks' too) and folder, the partial folder itself
    assert {"controller.pt", "meta.json", "rng_rank0.pt", "rng_rank1.pt", "deepspeed", "hf"} <= {str(p) for p in on_disk}
    assert ("fsync", str(final.parent)) in events[renamed_at:]  # checkpoints/: the rename is on disk
