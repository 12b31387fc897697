"""The protobuf messages the Tinker SDK exchanges with a server, read and written by hand.

The SDK (tinker 0.38) sends `forward_backward` bodies as protobuf (`application/x-protobuf`,
optionally zstd-compressed) and asks for `SampleResponse` and `ForwardBackwardOutput` results
as protobuf (`Accept: application/x-protobuf`); every other body is JSON. The SDK is only a
test dependency of mmrl, so its generated `tinker_public_pb2` is not imported here: this module
speaks the protobuf wire format directly (varints and length-delimited fields), with the field
numbers of the SDK's public schema written down below. Unknown fields are skipped, as protobuf
readers do.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any, Iterator

import numpy as np

# Tensor.dtype enum (DTYPE_*) -> numpy
DTYPES = {1: np.float32, 2: np.int64, 3: np.int32}
DTYPE_CODE = {"float32": 1, "int64": 2, "int32": 3}
STOP_REASON_CODE = {"stop": 0, "length": 1}


class WireError(ValueError):
    """A body that is not the message it claims to be (answered 400, naming `field`)."""

    def __init__(self, message: str, field: str = "body"):
        super().__init__(message)
        self.field = field


# ---- reading -------------------------------------------------------------------------------------
def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise WireError("truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 70:
            raise WireError("varint too long")


def fields(buf: bytes) -> Iterator[tuple[int, int, Any]]:
    """(field number, wire type, value) of every field in `buf`, in order."""
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        num, wt = key >> 3, key & 7
        if wt == 0:
            val, pos = _varint(buf, pos)
        elif wt == 1:
            val, pos = buf[pos:pos + 8], pos + 8
        elif wt == 2:
            n, pos = _varint(buf, pos)
            if pos + n > len(buf):
                raise WireError(f"field {num}: length {n} runs past the end of the message")
            val, pos = buf[pos:pos + n], pos + n
        elif wt == 5:
            val, pos = buf[pos:pos + 4], pos + 4
        else:
            raise WireError(f"field {num}: unsupported wire type {wt}")
        yield num, wt, val


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def _packed_varints(wt: int, val: Any) -> list[int]:
    if wt == 0:
        return [_signed(val)]
    out, pos = [], 0
    while pos < len(val):
        v, pos = _varint(val, pos)
        out.append(_signed(v))
    return out


def read_tensor(buf: bytes, where: str) -> np.ndarray:
    """A `Tensor` message as a dense numpy array (a sparse CSR one is expanded)."""
    dense, csr, dtype, shape = None, None, 0, []
    for num, wt, val in fields(buf):
        if num == 1:
            dense = val
        elif num == 2:
            csr = {n: v for n, _, v in fields(val)}
        elif num == 3:
            dtype = val
        elif num == 4:
            shape += _packed_varints(wt, val)
    if dtype not in DTYPES:
        raise WireError(f"{where}: unsupported tensor dtype code {dtype} (float32 or int64)", where)
    np_dtype = np.dtype(DTYPES[dtype])
    if csr is not None:
        values = np.frombuffer(csr.get(1, b""), dtype=np_dtype)
        crow = np.frombuffer(csr.get(2, b""), dtype=np.int64)
        col = np.frombuffer(csr.get(3, b""), dtype=np.int64)
        if len(shape) != 2 or len(crow) != shape[0] + 1 or len(col) != len(values):
            raise WireError(f"{where}: inconsistent sparse CSR tensor (shape {shape})", where)
        out = np.zeros(shape, dtype=np_dtype)
        for r in range(shape[0]):
            out[r, col[crow[r]:crow[r + 1]]] = values[crow[r]:crow[r + 1]]
        return out
    raw = dense or b""
    if len(raw) % np_dtype.itemsize:
        raise WireError(f"{where}: {len(raw)} bytes is not a whole number of {np_dtype} values", where)
    arr = np.frombuffer(raw, dtype=np_dtype)
    if shape:
        if int(np.prod(shape)) != arr.size:
            raise WireError(f"{where}: shape {shape} does not match {arr.size} values", where)
        arr = arr.reshape(shape)
    return arr


@dataclass
class Chunk:
    kind: str  # "encoded_text" | "image"
    tokens: list[int] = field(default_factory=list)
    data: bytes = b""
    format: str = ""
    expected_tokens: int | None = None


@dataclass
class Datum:
    chunks: list[Chunk]
    loss_fn_inputs: dict[str, np.ndarray]


@dataclass
class ForwardBackwardRequest:
    model_id: str = ""
    seq_id: int = 0
    data: list[Datum] = field(default_factory=list)
    loss_fn: str = ""
    loss_fn_config: dict[str, float | str] = field(default_factory=dict)
    forward_only: bool = False


def _read_chunk(buf: bytes, where: str) -> Chunk:
    for num, _, val in fields(buf):
        if num == 1:
            toks = {n: v for n, _, v in fields(val)}.get(1, b"")
            if len(toks) % 4:
                raise WireError(f"{where}.tokens: not int32 values", where)
            return Chunk("encoded_text", tokens=np.frombuffer(toks, dtype=np.int32).tolist())
        if num == 2:
            chunk = Chunk("image")
            for n, _, v in fields(val):
                if n == 1:
                    chunk.data = bytes(v)
                elif n == 2:
                    chunk.format = bytes(v).decode()
                elif n == 3:
                    chunk.expected_tokens = int(v)
            return chunk
        if num == 3:
            raise WireError(f"{where}: audio (dmel) chunks are not supported", where)
    raise WireError(f"{where}: empty chunk", where)


def _map_entry(buf: bytes) -> tuple[str, Any]:
    key, value = "", b""
    for num, _, val in fields(buf):
        if num == 1:
            key = bytes(val).decode()
        elif num == 2:
            value = val
    return key, value


def read_forward_backward_request(buf: bytes) -> ForwardBackwardRequest:
    req = ForwardBackwardRequest()
    legacy: dict[str, float] = {}
    for num, _, val in fields(buf):
        if num == 1:
            req.model_id = bytes(val).decode()
        elif num == 2:
            req.seq_id = _signed(val)
        elif num == 3:
            i = len(req.data)
            chunks, inputs = [], {}
            for n, _, v in fields(val):
                if n == 1:
                    chunks.append(_read_chunk(v, f"data[{i}].model_input.chunks[{len(chunks)}]"))
                elif n == 2:
                    key, tensor = _map_entry(v)
                    inputs[key] = read_tensor(tensor, f"data[{i}].loss_fn_inputs.{key}")
            req.data.append(Datum(chunks, inputs))
        elif num == 4:
            req.loss_fn = bytes(val).decode()
        elif num == 5:
            key, v = _map_entry(val)
            legacy[key] = struct.unpack("<d", v)[0] if v else 0.0
        elif num == 6:
            req.forward_only = bool(val)
        elif num == 7:
            key, v = _map_entry(val)
            for n, _, x in fields(v):
                req.loss_fn_config[key] = struct.unpack("<d", x)[0] if n == 1 else bytes(x).decode()
    for key, value in legacy.items():
        req.loss_fn_config.setdefault(key, value)
    return req


# ---- writing -------------------------------------------------------------------------------------
def _enc_varint(v: int) -> bytes:
    if v < 0:
        v += 1 << 64
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        if v:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _key(num: int, wt: int) -> bytes:
    return _enc_varint(num << 3 | wt)


def put_varint(num: int, v: int) -> bytes:
    return _key(num, 0) + _enc_varint(int(v)) if v else b""


def put_bytes(num: int, b: bytes) -> bytes:
    return _key(num, 2) + _enc_varint(len(b)) + b


def put_double(num: int, v: float) -> bytes:
    return _key(num, 1) + struct.pack("<d", float(v))


def sample_response(sequences: list[dict[str, Any]], prompt_logprobs: list[float] | None = None) -> bytes:
    """`SampleResponse`: sequences of {tokens, logprobs, stop_reason}; prompt logprobs with NaN
    where none was computed (the first token)."""
    out = b""
    for s in sequences:
        seq = put_varint(1, STOP_REASON_CODE[s["stop_reason"]])
        seq += put_bytes(2, np.asarray(s["tokens"], dtype=np.int32).tobytes())
        if s.get("logprobs") is not None:
            seq += put_bytes(3, np.asarray(s["logprobs"], dtype=np.float32).tobytes())
        out += put_bytes(1, seq)
    if prompt_logprobs is not None:
        arr = np.array([np.nan if x is None else x for x in prompt_logprobs], dtype=np.float32)
        out += put_bytes(2, arr.tobytes())
    return out


def _batched_tensor(arrays: list[np.ndarray]) -> bytes:
    """`BatchedTensor`: per-datum 1-D arrays laid end to end, byte offsets between them."""
    dtype = "int64" if all(np.issubdtype(a.dtype, np.integer) for a in arrays) else "float32"
    np_dtype = np.int64 if dtype == "int64" else np.float32
    parts = [np.ascontiguousarray(a, dtype=np_dtype).reshape(-1) for a in arrays]
    offsets = np.zeros(len(parts) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([p.nbytes for p in parts])
    data = b"".join(p.tobytes() for p in parts)
    return put_bytes(1, data) + put_bytes(2, offsets.tobytes()) + put_varint(3, DTYPE_CODE[dtype])


def forward_backward_output(outputs: list[dict[str, np.ndarray]], metrics: dict[str, float]) -> bytes:
    """`ForwardBackwardOutput` with one `ArrayRecord` holding every datum's outputs."""
    names = sorted({k for o in outputs for k in o})
    record = put_bytes(1, b"ArrayRecord")
    for name in names:
        entry = put_bytes(1, name.encode()) + put_bytes(2, _batched_tensor([o[name] for o in outputs]))
        record += put_bytes(2, entry)
    record += put_varint(3, len(outputs))
    out = put_bytes(1, b"ArrayRecord") + put_bytes(2, record)
    for key, value in metrics.items():
        out += put_bytes(3, put_bytes(1, key.encode()) + put_double(2, value))
    return out
