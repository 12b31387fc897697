"""Checkpoint bookkeeping and weight naming without engines: which checkpoints count as complete,
how a resumed run trims its logs, and how LoRA weights become plain HF weights."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from mmrl.controller.checkpoint import checkpoint_dir, latest_checkpoint, list_checkpoints, truncate_metrics
from mmrl.trainer.export import ExportError, resolve_checkpoint
from mmrl.weight_sync.gather import WeightUnit, buckets, export_name, merge_lora_state_dict


def _fake_checkpoint(run_dir: Path, step: int, complete: bool = True) -> Path:
    path = checkpoint_dir(run_dir, step)
    (path / "deepspeed").mkdir(parents=True)
    if complete:
        (path / "meta.json").write_text(json.dumps({"step": step}))
    return path


def test_only_complete_checkpoints_count(tmp_path: Path) -> None:
    _fake_checkpoint(tmp_path, 10)
    _fake_checkpoint(tmp_path, 20)
    _fake_checkpoint(tmp_path, 30, complete=False)  # killed while saving: no meta.json
    partial = checkpoint_dir(tmp_path, 40).with_name("step_000040.partial")
    (partial / "deepspeed").mkdir(parents=True)
    (partial / "meta.json").write_text("{}")
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000010", "step_000020"]
    assert latest_checkpoint(tmp_path).name == "step_000020"
    assert latest_checkpoint(tmp_path, before_step=20).name == "step_000010"
    assert latest_checkpoint(tmp_path, before_step=10) is None
    assert resolve_checkpoint(tmp_path).name == "step_000020"  # a run dir resolves to its newest
    try:
        resolve_checkpoint(tmp_path / "nothing")
    except ExportError as e:
        assert "checkpoint.every_steps" in str(e)
    else:
        raise AssertionError("expected ExportError")


def test_truncate_drops_later_steps_and_a_cut_line(tmp_path: Path) -> None:
    lines = [json.dumps({"step": s, "x": s}) for s in range(0, 7)] + ['{"step": 7, "x"']
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines))
    assert truncate_metrics(tmp_path, 4) == 3  # steps 5, 6 and the half-written line
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2, 3, 4]
    assert truncate_metrics(tmp_path, 4, name="missing.jsonl") == 0


def test_lora_names_and_merge() -> None:
    assert export_name("base_model.model.model.language_model.layers.0.self_attn.q_proj.base_layer.weight") == \
        "model.language_model.layers.0.self_attn.q_proj.weight"
    assert export_name("lm_head.weight") == "lm_head.weight"
    W, A, B = torch.ones(3, 2), torch.tensor([[1.0, 2.0]]), torch.tensor([[1.0], [0.0], [2.0]])
    state = {"base_model.model.layer.q_proj.base_layer.weight": W,
             "base_model.model.layer.q_proj.lora_A.default.weight": A,
             "base_model.model.layer.q_proj.lora_B.default.weight": B,
             "base_model.model.lm_head.weight": torch.zeros(2)}
    merged = merge_lora_state_dict(state, scaling=0.5)
    assert set(merged) == {"layer.q_proj.weight", "lm_head.weight"}
    # W + 0.5 * B @ A: rows 1 + 0.5*[1,2], 1 + 0, 1 + 0.5*[2,4]
    assert torch.equal(merged["layer.q_proj.weight"], torch.tensor([[1.5, 2.0], [1.0, 1.0], [2.0, 3.0]]))


def test_buckets_respect_the_size_and_keep_units_whole() -> None:
    units = [WeightUnit(f"w{i}", [torch.nn.Parameter(torch.zeros(2**18))]) for i in range(5)]  # 1 MiB each (fp32)
    sizes = [[u.name for u in b] for b in buckets(units, bucket_mb=2.5)]
    assert sizes == [["w0", "w1"], ["w2", "w3"], ["w4"]]
    big = [WeightUnit("big", [torch.nn.Parameter(torch.zeros(2**20))])]
    assert [[u.name for u in b] for b in buckets(big, bucket_mb=1)] == [["big"]]
