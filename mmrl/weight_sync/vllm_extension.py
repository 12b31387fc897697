"""Runs inside each vLLM worker process (LLM(worker_extension_cls=...)); called through
`llm.collective_rpc(method, args=...)`.

Buckets arrive as safetensors bytes: when the engine core runs in its own process, tensors
nested in RPC arguments are turned into plain lists, bytes are not. They are staged and loaded
in one `reload_weights` call, because the CPU runner repacks weights after loading and a bare
`model.load_weights()` cannot write into repacked parameters.
"""
from __future__ import annotations

import torch
from safetensors.torch import load as load_safetensors

from mmrl.rollout.vllm_logs import mark_config_only_modules


class WeightSyncExtension:
    _mmrl_staged: list[tuple[str, torch.Tensor]]

    def mmrl_stage_bucket(self, payload: bytes) -> int:
        if not hasattr(self, "_mmrl_staged"):
            self._mmrl_staged = []
        tensors = load_safetensors(bytes(payload))
        self._mmrl_staged.extend(tensors.items())
        return len(tensors)

    def mmrl_apply_staged(self) -> int:
        staged = getattr(self, "_mmrl_staged", [])
        self._mmrl_staged = []
        if not staged:
            return 0
        if not getattr(self, "_mmrl_marked", False):
            # the reload then warns "Failed to load weights" for rotary tables and the like,
            # which hold no checkpoint weights: see mmrl/rollout/vllm_logs.py
            mark_config_only_modules(self.model_runner.get_model())
            self._mmrl_marked = True
        # reload_weights also clears the worker-side encoder and multimodal caches; the caller
        # still resets the scheduler-side encoder cache and the prefix cache.
        self.model_runner.reload_weights(weights_iterator=iter(staged), is_checkpoint_format=True)
        return len(staged)

    def mmrl_weights_checksum(self) -> float:
        model = self.model_runner.get_model()
        return float(sum(p.detach().float().abs().sum().item() for p in model.parameters()))
