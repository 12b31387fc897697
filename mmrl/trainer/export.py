"""`mmrl export CKPT --out DIR`: a training checkpoint -> a Hugging Face model folder that
transformers and vLLM load like any other (weights as safetensors, config, tokenizer, processor).

The ZeRO-3 shards are consolidated offline on the CPU (no process group needed) with
DeepSpeed's own reader; LoRA adapters, when the run used them, are merged into the weights.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import torch

from mmrl.controller.checkpoint import latest_checkpoint, read_meta
from mmrl.weight_sync.gather import merge_lora_state_dict


class ExportError(ValueError):
    pass


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder, or a run directory (its newest checkpoint)."""
    p = Path(path)
    if (p / "meta.json").exists() and (p / "deepspeed").is_dir():
        return p
    found = latest_checkpoint(p)
    if found is None:
        raise ExportError(f"{p} is neither a checkpoint (RUN_DIR/checkpoints/step_N with meta.json) nor a run "
                          f"directory with complete checkpoints; train with checkpoint.every_steps=N to write some")
    return found


def consolidated_state_dict(ckpt: Path) -> dict[str, torch.Tensor]:
    """Full fp32 weights under HF names (LoRA merged) from a checkpoint's ZeRO-3 shards."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = get_fp32_state_dict_from_zero_checkpoint(str(ckpt), tag="deepspeed")
    meta = read_meta(ckpt)
    if meta.get("lora_scaling") is not None:
        state = merge_lora_state_dict(state, float(meta["lora_scaling"]))
    return state


def export_checkpoint(path: str | Path, out: str | Path, dtype: str | None = None) -> Path:
    """Write the HF folder; returns its path. `dtype` (float32/bfloat16) defaults to the
    model config's dtype."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    ckpt = resolve_checkpoint(path)
    hf_files = ckpt / "hf"
    if not (hf_files / "config.json").exists():
        raise ExportError(f"{ckpt} has no hf/config.json (a checkpoint written by an older mmrl?)")
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ExportError(f"{out} exists and is not empty; choose a new --out folder")
    config = AutoConfig.from_pretrained(hf_files)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    state = consolidated_state_dict(ckpt)
    expected = set(model.state_dict())
    missing = expected - set(state)
    tied = {k for k in missing if k.endswith("lm_head.weight")} if getattr(config, "tie_word_embeddings", False) else set()
    if missing - tied:
        raise ExportError(f"{ckpt}: the checkpoint lacks {len(missing - tied)} weights the model needs, e.g. "
                          f"{sorted(missing - tied)[:3]}")
    model.load_state_dict({k: v for k, v in state.items() if k in expected}, strict=False, assign=True)
    if tied:
        model.tie_weights()
    target = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(dtype or "", None)
    if target is not None:
        model = model.to(target)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for f in hf_files.iterdir():  # tokenizer, processor and chat template files
        if f.is_file() and not (out / f.name).exists():
            shutil.copy2(f, out / f.name)
    from mmrl import registry
    from mmrl.processors.base import families

    known = families()
    if config.model_type in known:  # the engine must load the export (the family's adapter fixes names)
        registry.resolve("processor", known[config.model_type]).finish_saved_model(out)
    return out
