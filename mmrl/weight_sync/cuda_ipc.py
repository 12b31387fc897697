"""The CUDA IPC transport (engines colocated on trainer rank 0's GPU): each bucket's flat GPU buffer
is shared by a CUDA IPC handle; every engine maps it, copies it and loads the copy at once.

A handle is `torch.multiprocessing.reductions.reduce_tensor`'s (rebuild function, arguments),
pickled into bytes (bytes pass through Ray and vLLM's collective_rpc unchanged), tagged with the
physical GPU's UUID: device indices differ per process (each sees its own CUDA_VISIBLE_DEVICES),
so the receiver checks the UUID and rebuilds on its own index of that GPU. Needs CUDA; config
load refuses it elsewhere (transport.config_problem).
"""
from __future__ import annotations

import inspect
import pickle
from typing import Any, Callable, Sequence

import ray
import torch

from mmrl.weight_sync.collective import begin_engines, finish_engines
from mmrl.weight_sync.packing import BucketHeader, pack_bucket, unpack_bucket


def gpu_uuid(index: int | None = None) -> str:
    """The physical GPU's UUID (the same in every process, whatever its device numbering)."""
    return str(torch.cuda.get_device_properties(torch.cuda.current_device() if index is None else index).uuid)


def export_handle(flat: torch.Tensor) -> bytes:
    """Share `flat` (a CUDA tensor that the caller keeps alive until every receiver is done)."""
    from torch.multiprocessing.reductions import reduce_tensor

    rebuild, args = reduce_tensor(flat)
    return pickle.dumps({"gpu": gpu_uuid(flat.device.index), "rebuild": rebuild, "args": args})


def _with_device(rebuild: Callable[..., Any], args: tuple, index: int) -> tuple:
    """`args` with the storage's device index replaced by `index` (found by parameter name)."""
    names = list(inspect.signature(rebuild).parameters)
    position = names.index("storage_device")
    return args[:position] + (index,) + args[position + 1:]


def import_handle(handle: bytes, device_index: int) -> torch.Tensor:
    """The sender's tensor, mapped into this process on its own index of the same GPU."""
    shared = pickle.loads(handle)
    mine = gpu_uuid(device_index)
    if shared["gpu"] != mine:
        raise RuntimeError(f"CUDA IPC handle is for GPU {shared['gpu']} but this engine worker runs on {mine}: "
                           f"cuda_ipc needs every engine on trainer rank 0's GPU (use weight_sync.transport=collective)")
    return shared["rebuild"](*_with_device(shared["rebuild"], shared["args"], device_index))


def receive_ipc_bucket(header_json: str, handle: bytes, device_index: int) -> list[tuple[str, torch.Tensor]]:
    """The bucket's tensors, copied out of the shared buffer: the copy lets the sender free the
    buffer as soon as this returns, even when a layer keeps part of the bucket until the rest of
    its weights arrive."""
    header = BucketHeader.from_json(header_json)
    shared = import_handle(handle, device_index)
    own = shared.clone()
    torch.cuda.current_stream().synchronize()  # the copy is done before the sender may reuse the memory
    del shared
    return unpack_bucket(header, own)


class CudaIpcSender:
    device = "cuda"

    def __init__(self, engines: Sequence[Any], timeout_s: float):
        self.engines, self.timeout_s = list(engines), timeout_s
        begin_engines(self.engines, timeout_s)

    def send(self, tensors: dict[str, torch.Tensor]) -> int:
        header, flat = pack_bucket(tensors, torch.device("cuda", torch.cuda.current_device()))
        torch.cuda.current_stream().synchronize()  # the receivers read what the pack wrote
        handle = export_handle(flat)
        # `flat` stays alive until every engine has copied it (receive_ipc_bucket)
        ray.get([e.receive_bucket_ipc.remote(header.to_json(), handle) for e in self.engines], timeout=self.timeout_s)
        return header.nbytes

    def finish(self, version: int) -> dict[str, float]:
        return finish_engines(self.engines, version, self.timeout_s)

    def abort(self) -> None:
        finish_engines(self.engines, None, self.timeout_s)
