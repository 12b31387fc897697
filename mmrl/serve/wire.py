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

import math
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
        elif wt in (1, 5):
            n = 8 if wt == 1 else 4
            if pos + n > len(buf):
                raise WireError(f"field {num}: {n}-byte value runs past the end of the message")
            val, pos = buf[pos:pos + n], pos + n
        elif wt == 2:
            n, pos = _varint(buf, pos)
            if pos + n > len(buf):
                raise WireError(f"field {num}: length {n} runs past the end of the message")
            val, pos = buf[pos:pos + n], pos + n
        else:
            raise WireError(f"field {num}: unsupported wire type {wt}")
        yield num, wt, val


# A field's value as its schema type: a sender that put another wire type there is a 400 naming the
# field (not a TypeError deep in the reader).
def _msg(wt: int, val: Any, where: str) -> bytes:
    if wt != 2:
        raise WireError(f"{where}: expected bytes or a message (wire type 2), got wire type {wt}", where)
    return bytes(val)


def _text(wt: int, val: Any, where: str) -> str:
    try:
        return _msg(wt, val, where).decode()
    except UnicodeDecodeError:
        raise WireError(f"{where}: not UTF-8 text", where) from None


def _int(wt: int, val: Any, where: str) -> int:
    if wt != 0:
        raise WireError(f"{where}: expected an integer (wire type 0), got wire type {wt}", where)
    return _signed(val)


def _double(wt: int, val: Any, where: str) -> float:
    if wt != 1:
        raise WireError(f"{where}: expected a double (wire type 1), got wire type {wt}", where)
    return struct.unpack("<d", val)[0]


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v


def _packed_varints(wt: int, val: Any, where: str) -> list[int]:
    if wt == 0:
        return [_signed(val)]
    out, pos, buf = [], 0, _msg(wt, val, where)
    while pos < len(buf):
        v, pos = _varint(buf, pos)
        out.append(_signed(v))
    return out


def _array(raw: bytes, dtype: np.dtype, where: str) -> np.ndarray:
    if len(raw) % dtype.itemsize:
        raise WireError(f"{where}: {len(raw)} bytes is not a whole number of {dtype} values", where)
    return np.frombuffer(raw, dtype=dtype)


MAX_TENSOR_VALUES = 1 << 24  # a loss input holds one value per token: far below this


def read_tensor(buf: bytes, where: str) -> np.ndarray:
    """A `Tensor` message as a dense numpy array (a sparse CSR one is expanded)."""
    dense, csr, dtype, shape = None, None, 0, []
    for num, wt, val in fields(buf):
        if num == 1:
            dense = _msg(wt, val, where)
        elif num == 2:
            csr = {n: _msg(w, v, where) for n, w, v in fields(_msg(wt, val, where))}
        elif num == 3:
            dtype = _int(wt, val, where)
        elif num == 4:
            shape += _packed_varints(wt, val, where)
    if dtype not in DTYPES:
        raise WireError(f"{where}: unsupported tensor dtype code {dtype} (float32 or int64)", where)
    if any(d < 0 for d in shape) or math.prod(shape) > MAX_TENSOR_VALUES:
        raise WireError(f"{where}: shape {shape} is not a tensor of at most {MAX_TENSOR_VALUES} values", where)
    np_dtype = np.dtype(DTYPES[dtype])
    if csr is not None:
        values = _array(csr.get(1, b""), np_dtype, where)
        crow = _array(csr.get(2, b""), np.dtype(np.int64), where)
        col = _array(csr.get(3, b""), np.dtype(np.int64), where)
        if (len(shape) != 2 or len(crow) != shape[0] + 1 or len(col) != len(values) or crow[0] != 0
                or crow[-1] != len(values) or (np.diff(crow) < 0).any() or ((col < 0) | (col >= shape[1])).any()):
            raise WireError(f"{where}: inconsistent sparse CSR tensor (shape {shape})", where)
        out = np.zeros(shape, dtype=np_dtype)
        for r in range(shape[0]):
            out[r, col[crow[r]:crow[r + 1]]] = values[crow[r]:crow[r + 1]]
        return out
    arr = _array(dense or b"", np_dtype, where)
    if shape:
        if math.prod(shape) != arr.size:
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
    for num, wt, val in fields(buf):
        if num == 1:
            toks = b""
            for n, w, v in fields(_msg(wt, val, where)):
                if n == 1:
                    toks = _msg(w, v, f"{where}.tokens")
            if len(toks) % 4:
                raise WireError(f"{where}.tokens: not int32 values", where)
            return Chunk("encoded_text", tokens=np.frombuffer(toks, dtype=np.int32).tolist())
        if num == 2:
            chunk = Chunk("image")
            for n, w, v in fields(_msg(wt, val, where)):
                if n == 1:
                    chunk.data = _msg(w, v, f"{where}.data")
                elif n == 2:
                    chunk.format = _text(w, v, f"{where}.format")
                elif n == 3:
                    chunk.expected_tokens = _int(w, v, f"{where}.expected_tokens")
            return chunk
        if num == 3:
            raise WireError(f"{where}: audio (dmel) chunks are not supported", where)
    raise WireError(f"{where}: empty chunk", where)


def _map_entry(wt: int, buf: Any, where: str) -> tuple[str, int, Any]:
    """(key, wire type of the value, value) of a map<string, ...> entry."""
    key, value_wt, value = "", 2, b""
    for num, w, val in fields(_msg(wt, buf, where)):
        if num == 1:
            key = _text(w, val, f"{where} key")
        elif num == 2:
            value_wt, value = w, val
    return key, value_wt, value


def read_forward_backward_request(buf: bytes) -> ForwardBackwardRequest:
    req = ForwardBackwardRequest()
    legacy: dict[str, float] = {}
    for num, wt, val in fields(buf):
        if num == 1:
            req.model_id = _text(wt, val, "model_id")
        elif num == 2:
            req.seq_id = _int(wt, val, "seq_id")
        elif num == 3:
            i = len(req.data)
            chunks, inputs = [], {}
            for n, w, v in fields(_msg(wt, val, f"data[{i}]")):
                if n == 1:
                    chunks.append(_read_chunk(_msg(w, v, f"data[{i}].model_input"),
                                              f"data[{i}].model_input.chunks[{len(chunks)}]"))
                elif n == 2:
                    key, tw, tensor = _map_entry(w, v, f"data[{i}].loss_fn_inputs")
                    where = f"data[{i}].loss_fn_inputs.{key}"
                    inputs[key] = read_tensor(_msg(tw, tensor, where), where)
            req.data.append(Datum(chunks, inputs))
        elif num == 4:
            req.loss_fn = _text(wt, val, "loss_fn")
        elif num == 5:
            key, vw, v = _map_entry(wt, val, "loss_fn_config")
            legacy[key] = _double(vw, v, f"loss_fn_config.{key}") if v else 0.0
        elif num == 6:
            req.forward_only = bool(_int(wt, val, "forward_only"))
        elif num == 7:
            key, vw, v = _map_entry(wt, val, "loss_fn_config")
            where = f"loss_fn_config.{key}"
            for n, w, x in fields(_msg(vw, v, where)):
                if n in (1, 2):  # a number or a string
                    req.loss_fn_config[key] = _double(w, x, where) if n == 1 else _text(w, x, where)
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
