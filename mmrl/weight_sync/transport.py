"""Which transport carries the weight buckets from trainer rank 0 to the engines, and the
contract every transport's sender keeps (`Sender`).

- object_store: safetensors bytes through Ray's object store; each engine stages every bucket,
  then loads them in one reload (a second full copy of the weights in the engine meanwhile).
- collective: a process group of rank 0 and the engines' vLLM workers; rank 0 broadcasts each
  bucket's flat buffer and every engine loads it straight away (one bucket staged at a time).
- cuda_ipc: rank 0 shares each bucket's GPU buffer by CUDA IPC handle with engines on its own GPU
  (colocated); they copy and load it straight away. No bytes cross a wire.

`auto`: object_store on CPU, where the issue keeps today's transport. Measured on a 2-core
machine (a 50 M-parameter Qwen2.5-VL, 200 MB fp32, 16 MB buckets, 2 ranks, 1 engine): the
collective synced in 0.61 s against 0.80 s and staged 28 MB in the engine against 200 MB, but
generation stood still for the whole 0.61 s against the object store's 0.18 s load, because the
first bucket goes into the live model; in an async run that pause is lost rollout time, and on
CPU the models are small enough for the staged copy. So on CPU the collective is opt-in (large
models, tight memory). On CUDA the staged copy is what limits a large VLM (the engine's GPU
memory) and NCCL moves buckets GPU to GPU without the object store's host round trip:
collective between distinct GPUs, cuda_ipc when every engine sits on rank 0's GPU (NCCL refuses
two ranks on one GPU).
"""
from __future__ import annotations

from typing import Protocol, Sequence

import torch

OBJECT_STORE, COLLECTIVE, CUDA_IPC, AUTO = "object_store", "collective", "cuda_ipc", "auto"
TRANSPORTS = (AUTO, OBJECT_STORE, COLLECTIVE, CUDA_IPC)


class Sender(Protocol):
    """Rank 0's side of one sync: `send` each gathered bucket, then `finish` (or `abort`)."""

    device: str  # where the bucket's tensors should be when handed to `send` ("cpu" | "cuda")

    def send(self, tensors: dict[str, torch.Tensor]) -> int:
        """Hand one bucket over; returns the bytes sent."""
        ...

    def finish(self, version: int) -> dict[str, float]:
        """Every engine has the weights as `version`; returns at least `apply_s` (the longest
        engine-side pause or load)."""
        ...

    def abort(self) -> None:
        """The sync failed part way: engines resume generation (weights possibly mixed, version unchanged)."""
        ...


def config_problem(transport: str, device: str) -> str | None:
    """Why `transport` cannot run on `device` (a resolved "cpu" | "cuda"), or None."""
    if transport == CUDA_IPC and device != "cuda":
        return ("weight_sync.transport=cuda_ipc shares GPU memory between processes and needs CUDA, but this run's "
                f"device is {device}. Use weight_sync.transport=collective (gloo on CPU) or object_store, or run "
                "with cluster.device=cuda on a GPU machine.")
    return None


def resolve(transport: str, device: str, engine_gpus: Sequence[Sequence[str | None]] = (),
            sender_gpu: str | None = None) -> tuple[str, str | None]:
    """(transport, group backend or None) for this sync. `engine_gpus`: each engine's workers'
    GPU UUIDs; `sender_gpu`: rank 0's GPU UUID (both only needed on CUDA)."""
    if transport not in TRANSPORTS:
        raise ValueError(f"weight_sync.transport must be one of {TRANSPORTS}, got {transport!r}")
    problem = config_problem(transport, device)
    if problem:
        raise ValueError(problem)
    if transport == OBJECT_STORE or (transport == AUTO and device != "cuda"):
        return OBJECT_STORE, None
    if device != "cuda":
        return COLLECTIVE, "gloo"
    shared = [any(g == sender_gpu for g in gpus) for gpus in engine_gpus]
    if transport == AUTO:
        transport = CUDA_IPC if shared and all(shared) else COLLECTIVE
    if transport == CUDA_IPC:
        apart = [i for i, s in enumerate(shared) if not s]
        if apart or not shared:
            raise ValueError(f"weight_sync.transport=cuda_ipc: engine(s) {apart} are not on trainer rank 0's GPU "
                             f"({sender_gpu}); CUDA IPC shares memory on one GPU only. Use "
                             f"weight_sync.transport=collective for engines on other GPUs.")
        return CUDA_IPC, None
    # NCCL cannot hold two ranks on one GPU: where an engine shares rank 0's GPU the group runs
    # on gloo through host memory (slower, still one bucket at a time; cuda_ipc is the fast path)
    return COLLECTIVE, "gloo" if any(shared) else "nccl"
