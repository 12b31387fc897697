"""mmrl's hand-written protobuf codec (mmrl/serve/wire.py) against the SDK's own encoders/decoders."""
from __future__ import annotations

import numpy as np
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402
from tinker.proto.request_conv import forward_backward_request_to_proto  # noqa: E402
from tinker.proto.response_conv import (deserialize_forward_backward_output,  # noqa: E402
                                        deserialize_sample_response)

from mmrl.serve import wire  # noqa: E402


def test_forward_backward_request_decodes():
    datum = types.Datum(
        model_input=types.ModelInput(chunks=[types.EncodedTextChunk(tokens=[5, 6, 7]),
                                             types.ImageChunk(data=b"\x89PNG..", format="png", expected_tokens=4),
                                             types.EncodedTextChunk(tokens=[8])]),
        loss_fn_inputs={"target_tokens": np.array([6, 7, 8, 9, 1, 2, 3, 4], dtype=np.int64),
                        "advantages": np.linspace(-1, 1, 8).astype(np.float32)})
    req = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[datum], loss_fn="ppo",
                                                          loss_fn_config={"clip_low_threshold": 0.7, "mode": "x"}),
        model_id="model-abc", seq_id=3)
    buf = forward_backward_request_to_proto(req).SerializeToString()
    got = wire.read_forward_backward_request(buf)
    assert (got.model_id, got.seq_id, got.loss_fn, got.forward_only) == ("model-abc", 3, "ppo", False)
    assert got.loss_fn_config == {"clip_low_threshold": pytest.approx(0.7), "mode": "x"}
    (d,) = got.data
    assert [c.kind for c in d.chunks] == ["encoded_text", "image", "encoded_text"]
    assert d.chunks[0].tokens == [5, 6, 7] and d.chunks[2].tokens == [8]
    assert (d.chunks[1].data, d.chunks[1].format, d.chunks[1].expected_tokens) == (b"\x89PNG..", "png", 4)
    np.testing.assert_array_equal(d.loss_fn_inputs["target_tokens"], [6, 7, 8, 9, 1, 2, 3, 4])
    np.testing.assert_allclose(d.loss_fn_inputs["advantages"], np.linspace(-1, 1, 8), rtol=1e-6)


def test_sparse_tensor_decodes_dense():
    td = types.TensorData(data=[1.0, 2.0], dtype="float32", shape=[2, 3], sparse_crow_indices=[0, 1, 2],
                          sparse_col_indices=[2, 0])
    datum = types.Datum(model_input=types.ModelInput.from_ints([1, 2]), loss_fn_inputs={"weights": td})
    req = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[datum], loss_fn="cross_entropy"), model_id="m", seq_id=1)
    got = wire.read_forward_backward_request(forward_backward_request_to_proto(req).SerializeToString())
    np.testing.assert_array_equal(got.data[0].loss_fn_inputs["weights"], [[0, 0, 1], [2, 0, 0]])


def test_truncated_body_is_a_wire_error():
    with pytest.raises(wire.WireError):
        wire.read_forward_backward_request(b"\x1a\xff\x01abc")


def test_sample_response_encodes():
    buf = wire.sample_response([{"tokens": [1, 2, 3], "logprobs": [-0.5, -1.0, -2.0], "stop_reason": "length"},
                                {"tokens": [4], "logprobs": [-0.25], "stop_reason": "stop"}],
                               prompt_logprobs=[None, -1.5, -2.5])
    res = deserialize_sample_response(buf)
    assert [s.tokens for s in res.sequences] == [[1, 2, 3], [4]]
    assert [s.stop_reason for s in res.sequences] == ["length", "stop"]
    assert res.sequences[0].logprobs == [-0.5, -1.0, -2.0]
    assert res.prompt_logprobs == [None, -1.5, -2.5]


def test_forward_backward_output_encodes():
    outs = [{"logprobs": np.array([-1.0, -2.0], dtype=np.float32)},
            {"logprobs": np.array([-3.0], dtype=np.float32)}]
    res = deserialize_forward_backward_output(wire.forward_backward_output(outs, {"loss:sum": 6.0}))
    assert res.metrics == {"loss:sum": 6.0}
    assert [o["logprobs"].tolist() for o in res.loss_fn_outputs] == [[-1.0, -2.0], [-3.0]]


@pytest.mark.parametrize("body,field", [
    (b"\x08\xff\xff\xff\xff\x0f", "model_id"),  # a string field sent as a varint (was bytes(4294967295))
    (b"\x22\x02\xff\xfe", "loss_fn"),  # not UTF-8 (was UnicodeDecodeError)
    (b"\x15\x00\x00\x00\x00", "seq_id"),  # an integer sent as a 4-byte value
    (b"\x2a\x0b\x0a\x01k\x12\x06abcdef", "loss_fn_config.k"),  # a double 6 bytes long (was struct.error)
    (b"\x1a\x03\x08\x01\x00", "data[0].model_input"),  # a chunk list sent as a varint
], ids=["string-as-varint", "not-utf8", "int-as-fixed32", "short-double", "chunks-as-varint"])
def test_mistyped_field_is_a_wire_error_naming_it(body, field):
    with pytest.raises(wire.WireError) as err:
        wire.read_forward_backward_request(body)
    assert err.value.field == field


def test_inconsistent_sparse_tensor_is_a_wire_error():
    def tensor(shape: list[int], cols: list[int]) -> bytes:
        csr = (wire.put_bytes(1, np.array([1.0], dtype=np.float32).tobytes())
               + wire.put_bytes(2, np.array([0, 1], dtype=np.int64).tobytes())
               + wire.put_bytes(3, np.array(cols, dtype=np.int64).tobytes()))
        shape_bytes = b"".join(wire._enc_varint(d) for d in shape)
        return wire.put_bytes(2, csr) + wire.put_varint(3, 1) + wire.put_bytes(4, shape_bytes)

    def request(t: bytes) -> bytes:
        entry = wire.put_bytes(1, b"weights") + wire.put_bytes(2, t)
        return wire.put_bytes(3, wire.put_bytes(2, entry))

    assert wire.read_forward_backward_request(request(tensor([1, 3], [2]))).data[0].loss_fn_inputs[
        "weights"].tolist() == [[0, 0, 1]]
    for shape, cols in (([1, 3], [3]), ([1, 1 << 40], [0])):  # a column past the row; a huge dense size
        with pytest.raises(wire.WireError) as err:
            wire.read_forward_backward_request(request(tensor(shape, cols)))
        assert err.value.field == "data[0].loss_fn_inputs.weights"
