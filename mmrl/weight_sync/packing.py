"""The wire format of one weight bucket: its tensors laid end to end in one flat byte buffer, and
a small header (names, dtypes, shapes, offsets) that travels apart from it.

One buffer per bucket means one collective (or one CUDA IPC handle) per bucket instead of one per
tensor, and the receiver can allocate it from the header alone. The header is JSON: plain text
survives every RPC path (vLLM's collective_rpc turns tensors nested in arguments into lists).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import torch

# Each tensor starts at a multiple of this many bytes: a byte slice can then be viewed as any
# dtype (the view needs an offset divisible by the element size) and copies stay aligned.
ALIGN = 64


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: str  # "float32", "bfloat16", ...
    shape: tuple[int, ...]
    offset: int  # bytes from the start of the bucket's buffer

    @property
    def nbytes(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * torch.empty((), dtype=dtype_of(self.dtype)).element_size()


@dataclass(frozen=True)
class BucketHeader:
    tensors: tuple[TensorMeta, ...]
    nbytes: int  # the flat buffer's size

    def to_json(self) -> str:
        return json.dumps({"nbytes": self.nbytes,
                           "tensors": [[m.name, m.dtype, list(m.shape), m.offset] for m in self.tensors]})

    @classmethod
    def from_json(cls, text: str) -> "BucketHeader":
        raw = json.loads(text)
        return cls(tuple(TensorMeta(n, d, tuple(s), o) for n, d, s, o in raw["tensors"]), int(raw["nbytes"]))


def dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return dtype


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def plan_bucket(tensors: dict[str, torch.Tensor]) -> BucketHeader:
    """Where each tensor goes in the flat buffer (no data is touched)."""
    metas, offset = [], 0
    for name, t in tensors.items():
        metas.append(TensorMeta(name, str(t.dtype).removeprefix("torch."), tuple(t.shape), offset))
        offset = _aligned(offset + t.numel() * t.element_size())
    return BucketHeader(tuple(metas), offset)


def pack_bucket(tensors: dict[str, torch.Tensor], device: torch.device | str = "cpu") -> tuple[BucketHeader, torch.Tensor]:
    """The header and a flat uint8 buffer on `device` holding every tensor's bytes."""
    header = plan_bucket(tensors)
    flat = torch.empty(header.nbytes, dtype=torch.uint8, device=device)
    for meta, t in zip(header.tensors, tensors.values()):
        n = meta.nbytes
        flat[meta.offset:meta.offset + n].copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
    return header, flat


def unpack_bucket(header: BucketHeader, flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) views into `flat` (no copy): they keep the buffer alive while referenced."""
    if flat.dtype != torch.uint8 or flat.numel() != header.nbytes:
        raise ValueError(f"bucket buffer is {flat.dtype} x {flat.numel()}, the header says uint8 x {header.nbytes}")
    return [(m.name, flat[m.offset:m.offset + m.nbytes].view(dtype_of(m.dtype)).view(m.shape))
            for m in header.tensors]
