"""vLLM's model-class records are shared between runs (rollout/model_info_cache.py): seeded into
a run's cache before its engine starts, kept from it once the engine is up."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from mmrl.rollout import model_info_cache
from mmrl.rollout.model_info_cache import FOLDER, keep_run_cache, seed_run_cache


def _record(folder: Path, name: str, module_hash: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    path.write_text(json.dumps({"hash": module_hash, "modelinfo": {"supports_multimodal": True}}))
    return path


def test_records_go_into_a_new_run_and_new_ones_come_back(tmp_path: Path) -> None:
    shared, run_a, run_b = tmp_path / "shared", tmp_path / "a" / "vllm", tmp_path / "b" / "vllm"
    assert seed_run_cache(run_a, shared) == []  # nothing shared yet (the folder does not exist)
    _record(run_a / FOLDER, "vllm-models-qwen2_5_vl-Qwen", "h1")  # vLLM inspected the class in run a
    assert keep_run_cache(run_a, shared) == ["vllm-models-qwen2_5_vl-Qwen.json"]
    assert keep_run_cache(run_a, shared) == []  # already there, same bytes
    # the next run starts with the record, so its engine skips the inspection
    assert seed_run_cache(run_b, shared) == ["vllm-models-qwen2_5_vl-Qwen.json"]
    assert (run_b / FOLDER / "vllm-models-qwen2_5_vl-Qwen.json").read_bytes() == \
        (shared / "vllm-models-qwen2_5_vl-Qwen.json").read_bytes()
    # a run whose vLLM rewrote the record (its model file changed) replaces the shared one
    _record(run_b / FOLDER, "vllm-models-qwen2_5_vl-Qwen", "h2")
    assert keep_run_cache(run_b, shared) == ["vllm-models-qwen2_5_vl-Qwen.json"]
    assert json.loads((shared / "vllm-models-qwen2_5_vl-Qwen.json").read_text())["hash"] == "h2"
    assert not [p for p in shared.iterdir() if p.name.startswith(".")]  # no temp files left


def test_an_unwritable_target_is_skipped_without_an_error(tmp_path: Path) -> None:
    run = tmp_path / "run"
    _record(run / FOLDER, "m", "h")
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the folder should be")
    assert keep_run_cache(run, blocked) == []
    assert seed_run_cache(tmp_path / "other", blocked) == []  # nothing to read there either


def test_the_shared_folder_is_per_python_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    first = model_info_cache.shared_dir()
    assert first.parent == tmp_path / ".cache" / "mmrl" / "vllm_modelinfos"
    monkeypatch.setattr("sys.prefix", "/another/venv")
    assert model_info_cache.shared_dir() != first
