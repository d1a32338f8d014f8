import pytest
import torch

from bloompeer.p2p import FLOAT_DTYPES, ProtocolError, tensor_from_wire, tensor_to_wire


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool])
def test_round_trip_is_exact(dtype):
    tensor = (torch.randn(2, 3, 5) * 100).to(dtype)
    decoded = tensor_from_wire(tensor_to_wire(tensor), "t", frozenset({str(dtype)[6:]}))
    assert decoded.dtype == dtype and decoded.shape == tensor.shape
    assert torch.equal(decoded, tensor)


def test_non_contiguous_and_empty_tensors():
    tensor = torch.randn(4, 6).t()
    assert torch.equal(tensor_from_wire(tensor_to_wire(tensor), "t", FLOAT_DTYPES), tensor)
    assert tensor_from_wire(tensor_to_wire(torch.empty(0, 3)), "t", FLOAT_DTYPES).shape == (0, 3)


def _wire(**overrides):
    return {**tensor_to_wire(torch.zeros(2, 3)), **overrides}


@pytest.mark.parametrize("wire", [
    _wire(dtype="int64"),  # not allowed for this field
    _wire(dtype="object"),
    _wire(dtype="complex64"),
    _wire(shape=[2, 4]),  # byte length does not match the shape
    _wire(shape=[3, 2, -1]),
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
        tensor_from_wire(wire, "t", FLOAT_DTYPES)


def test_decoded_tensor_owns_its_memory():
    wire = tensor_to_wire(torch.ones(4))
    decoded = tensor_from_wire(wire, "t", FLOAT_DTYPES)
    decoded += 1  # must not fail (writable) nor touch the frame's bytes
    assert tensor_from_wire(wire, "t", FLOAT_DTYPES).eq(1).all()
