import pytest
import torch

from bloompeer.p2p import FLOAT_DTYPES, ProtocolError, codecs, tensor_from_wire, tensor_to_wire
from bloompeer.p2p.tensors import MAX_TENSOR_EXTENT


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool])
def test_round_trip_is_exact(dtype):
    tensor = (torch.randn(2, 3, 5) * 100).to(dtype)
    decoded = tensor_from_wire(tensor_to_wire(tensor), "t", frozenset({str(dtype)[6:]}), 3)
    assert decoded.dtype == dtype and decoded.shape == tensor.shape
    assert torch.equal(decoded, tensor)


def test_non_contiguous_and_empty_tensors():
    tensor = torch.randn(4, 6).t()
    assert torch.equal(tensor_from_wire(tensor_to_wire(tensor), "t", FLOAT_DTYPES, 2), tensor)
    assert tensor_from_wire(tensor_to_wire(torch.empty(0, 3)), "t", FLOAT_DTYPES, 2).shape == (0, 3)


def _wire(**overrides):
    return {**tensor_to_wire(torch.zeros(2, 3)), **overrides}


@pytest.mark.parametrize("wire", [
    _wire(dtype="int64"),  # not allowed for this field
    _wire(dtype="object"),
    _wire(dtype="complex64"),
    _wire(shape=[2, 4]),  # byte length does not match the shape
    _wire(shape=[-2, -3]),  # negative dims, with the right number of values
    _wire(shape=[2, 3, 1]),  # a dim more than the field takes, with the right number of values
    _wire(shape=[6]),  # a dim less
    _wire(shape=[1, 1, 1, 1, 6]),  # too many dims
    _wire(shape=[2, 3.0]),
    _wire(shape="2,3"),
    _wire(shape=[1 << 62, 1 << 62]),  # absurd size, bytes do not match
    _wire(data="not bytes"),
    _wire(codec="pickle"),
    {**_wire(), "extra": 1},
    {"dtype": "float32", "shape": [1]},
    [1, 2, 3],
])
def test_malformed_tensors_are_refused(wire):
    with pytest.raises(ProtocolError):
        tensor_from_wire(wire, "t", FLOAT_DTYPES, 2)


def test_decoded_tensor_owns_its_memory():
    wire = tensor_to_wire(torch.ones(4))
    decoded = tensor_from_wire(wire, "t", FLOAT_DTYPES, 1)
    decoded += 1  # must not fail (writable) nor touch the frame's bytes
    assert tensor_from_wire(wire, "t", FLOAT_DTYPES, 1).eq(1).all()


@pytest.mark.parametrize("shape", [
    [1 << 62, 1 << 62, 0],  # torch: "Storage size calculation overflowed"
    [1 << 63, 0],  # torch: TypeError, "Overflow when unpacking long long"
    [(1 << 64) - 1, 0],
    [MAX_TENSOR_EXTENT + 1, 0],
    [1 << 25, 1 << 25, 0],  # each dim fine, their product absurd
])
def test_absurd_shapes_are_refused_even_without_values(shape):
    """No bytes are needed to claim them, as a dim of 0 makes the tensor empty."""
    with pytest.raises(ProtocolError):
        tensor_from_wire({"dtype": "float32", "shape": shape, "codec": "raw", "data": b""}, "t", FLOAT_DTYPES,
                         len(shape))


def test_the_largest_sane_empty_shape_decodes():
    assert tensor_from_wire(_wire(shape=[MAX_TENSOR_EXTENT, 0], data=b""), "t", FLOAT_DTYPES, 2).shape == \
        (MAX_TENSOR_EXTENT, 0)


def test_bool_values_are_zero_or_one():
    wire = tensor_to_wire(torch.tensor([True, False]))
    assert tensor_from_wire(wire, "t", frozenset({"bool"}), 1).tolist() == [True, False]
    with pytest.raises(ProtocolError):
        tensor_from_wire({**wire, "data": b"\x01\x02"}, "t", frozenset({"bool"}), 1)


@pytest.mark.parametrize("error", [RuntimeError("bad storage"), TypeError("bad size"), ValueError, OverflowError])
def test_a_torch_error_while_decoding_is_a_protocol_error(monkeypatch, error):
    """Whatever torch raises on a peer's tensor is the peer's bad data, never a crash of the handler."""
    def failing_decode(*args):
        raise error

    monkeypatch.setattr(codecs, "decode", failing_decode)
    with pytest.raises(ProtocolError):
        tensor_from_wire(tensor_to_wire(torch.ones(4)), "t", FLOAT_DTYPES, 1)
