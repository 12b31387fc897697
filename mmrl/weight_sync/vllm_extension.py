"""Runs inside each vLLM worker process (LLM(worker_extension_cls=...)); called through
`llm.collective_rpc(method, args=...)`.

Buckets arrive as safetensors bytes: when the engine core runs in its own process, tensors
nested in RPC arguments are turned into plain lists, bytes are not. They are staged and loaded
in one `reload_weights` call, because the CPU runner repacks weights after loading and a bare
`model.load_weights()` cannot write into repacked parameters.

The collective and cuda_ipc transports load bucket by bucket instead, inside one of vLLM's
layerwise reload sessions (`mmrl_begin_update` .. `mmrl_finish_update`): each layer is repacked
as soon as all of its weights have arrived, so the worker holds about one bucket at a time.
"""
from __future__ import annotations

from typing import Any

import torch
from safetensors.torch import load as load_safetensors

from mmrl.rollout.vllm_logs import mark_config_only_modules
from mmrl.weight_sync.cpu_moe import load_cpu_experts, split_expert_weights
from mmrl.weight_sync.packing import BucketHeader, unpack_bucket


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
        self._mmrl_mark_config_only()
        # MoE experts on CPU go in directly (the reload leaves them unusable: weight_sync/cpu_moe.py)
        staged, experts = split_expert_weights(self.model_runner.get_model(), staged)
        # reload_weights also clears the worker-side encoder and multimodal caches; the caller
        # still resets the scheduler-side encoder cache and the prefix cache.
        if staged:
            self.model_runner.reload_weights(weights_iterator=iter(staged), is_checkpoint_format=True)
        if experts:
            load_cpu_experts(self.model_runner.get_model(), experts)
            self.model_runner.reset_encoder_cache()
            self.model_runner.reset_mm_cache()
        return len(staged) + len(experts)

    def _mmrl_mark_config_only(self) -> None:
        if not getattr(self, "_mmrl_marked", False):
            # the reload then warns "Failed to load weights" for rotary tables and the like,
            # which hold no checkpoint weights: see mmrl/rollout/vllm_logs.py
            mark_config_only_modules(self.model_runner.get_model())
            self._mmrl_marked = True

    # ---- bucket by bucket (weight_sync/collective.py, weight_sync/cuda_ipc.py) ------------------
    def _mmrl_device(self) -> torch.device:
        return getattr(self, "device", None) or torch.device("cpu")

    def mmrl_worker_info(self) -> dict[str, Any]:
        """This worker's rank in its engine and its GPU's UUID (None on CPU)."""
        device = self._mmrl_device()
        gpu = str(torch.cuda.get_device_properties(device.index).uuid) if device.type == "cuda" else None
        return {"rank": int(getattr(self, "rank", 0)), "gpu": gpu}

    def mmrl_join_weight_group(self, host: str, port: int, first_rank: int, world_size: int, backend: str,
                               timeout_s: float, name: str) -> int:
        from mmrl.weight_sync.group import WeightGroup

        old = getattr(self, "_mmrl_group", None)
        if old is not None:  # the trainer formed a new group (an engine was replaced)
            old.close()
        if backend == "nccl":
            torch.cuda.set_device(self._mmrl_device())
        rank = first_rank + int(getattr(self, "rank", 0))
        self._mmrl_group = WeightGroup.join(host, port, rank, world_size, backend, timeout_s, name)
        return rank

    def mmrl_begin_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        self._mmrl_mark_config_only()
        initialize_layerwise_reload(self.model_runner.get_model())
        self._mmrl_session = {"buckets": 0, "tensors": 0, "bytes": 0, "peak_staged_bytes": 0}

    def _mmrl_load_bucket(self, weights: list[tuple[str, torch.Tensor]], nbytes: int) -> int:
        session = getattr(self, "_mmrl_session", None)
        if session is None:
            raise RuntimeError("a weight bucket arrived outside an update session (mmrl_begin_update first)")
        # staged now: this bucket plus what layers still keep of earlier ones (a layer whose
        # weights straddle two buckets waits for the rest before it is repacked)
        session["peak_staged_bytes"] = max(session["peak_staged_bytes"], nbytes + _held_bytes())
        model = self.model_runner.get_model()
        weights, experts = split_expert_weights(model, weights)
        if weights:
            model.load_weights(weights)
        if experts:
            load_cpu_experts(model, experts)
        session["buckets"] += 1
        session["tensors"] += len(weights) + len(experts)
        session["bytes"] += nbytes
        return len(weights) + len(experts)

    def mmrl_receive_bucket(self, header_json: str) -> int:
        """Join rank 0's broadcast of one bucket and load it into the model."""
        header = BucketHeader.from_json(header_json)
        group = self._mmrl_group
        flat = torch.empty(header.nbytes, dtype=torch.uint8, device=group.device)
        group.broadcast(flat)
        return self._mmrl_load_bucket(unpack_bucket(header, flat), header.nbytes)

    def mmrl_receive_bucket_ipc(self, header_json: str, handle: bytes) -> int:
        """Map rank 0's bucket (CUDA IPC, same GPU), copy it and load it into the model."""
        from mmrl.weight_sync.cuda_ipc import receive_ipc_bucket

        weights = receive_ipc_bucket(header_json, bytes(handle), self._mmrl_device().index)
        return self._mmrl_load_bucket(weights, BucketHeader.from_json(header_json).nbytes)

    def mmrl_finish_update(self) -> dict[str, float]:
        """Close the session: layers that got no weights keep theirs; the worker-side encoder and
        multimodal caches are dropped (the engine resets the scheduler-side ones)."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model_runner.get_model(), self.model_runner.model_config)
        self.model_runner.reset_encoder_cache()
        self.model_runner.reset_mm_cache()
        session = getattr(self, "_mmrl_session", None) or {}
        self._mmrl_session = None
        return {**{k: float(v) for k, v in session.items()},
                "staged_tensors": float(len(getattr(self, "_mmrl_staged", [])))}

    # ---- routing replay (R3): the experts each MoE layer chose, per request (rollout/routing_capture.py)
    def mmrl_capture_routing(self) -> list[int]:
        """Start recording the routed experts of every request; returns the MoE layer indices."""
        from mmrl.rollout.routing_capture import RoutingCapture, has_moe_layers

        model = self.model_runner.get_model()
        if not has_moe_layers(model):  # a dense model: nothing to record
            return []
        if getattr(self, "_mmrl_routing", None) is None:
            self._mmrl_routing = RoutingCapture(model, self.model_runner)
        return list(self._mmrl_routing.layer_ids)

    def mmrl_take_routing(self, request_id: str, num_tokens: int) -> dict[str, Any]:
        """A finished request's routed experts: {"rows", "data": int16 bytes (rows, MoE layers, top-k)}."""
        return self._mmrl_routing.take(request_id, num_tokens)

    def mmrl_weights_checksum(self) -> float:
        model = self.model_runner.get_model()
        return float(sum(p.detach().float().abs().sum().item() for p in model.parameters()))


def _held_bytes() -> int:
    """Bytes of received weights that vLLM's layerwise reload still buffers (layers waiting for
    the rest of their weights), counted by the memory they keep alive (a view keeps its whole
    bucket buffer)."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    storages: dict[int, int] = {}
    for info in list(LAYERWISE_INFO.values()):
        for _, bound in info.loaded_weights:
            for value in bound.arguments.values():
                if isinstance(value, torch.Tensor) and value.device.type != "meta":
                    storage = value.untyped_storage()
                    storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())
