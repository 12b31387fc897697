"""mmrl's ZeRO-3 defaults; `trainer.deepspeed` in the run config is merged on top (native JSON)."""
from __future__ import annotations

import copy
from typing import Any


def _deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def build_deepspeed_config(*, grad_clip: float, bf16: bool, user: dict[str, Any] | None = None) -> dict[str, Any]:
    base: dict[str, Any] = {
        # Micro-batches vary with the rollout (lengths, dynamic filtering), so mmrl owns the
        # accumulation: backward() only accumulates, step() reduces and updates.
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "managed_gradient_accumulation": False,
        "gradient_clipping": grad_clip,
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": False,
            "contiguous_gradients": True,
            "stage3_param_persistence_threshold": 0,
            "stage3_max_live_parameters": 1e8,
            "stage3_prefetch_bucket_size": 1e7,
            "reduce_bucket_size": 1e7,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "bf16": {"enabled": bf16},
        "fp16": {"enabled": False},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    return _deep_merge(base, user or {})
