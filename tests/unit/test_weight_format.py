"""How a server stores its weights, as one value (bloompeer/weight_format.py): what it accepts, what
decides its arithmetic, and the constants every room takes from it."""

import dataclasses

import pytest
import torch

from bloompeer.blocks.quantized_linear import check_int4_shape
from bloompeer.p2p import FLOAT_DTYPES
from bloompeer.peer.server.config import ServerConfig
from bloompeer.weight_format import DEFAULT_GROUP_SIZE, DTYPES, INT4_GROUP_SIZES, WeightFormat


def test_of_normalizes_what_a_server_is_told():
    assert WeightFormat.of("int4", 32, "bfloat16", "cuda:1") == WeightFormat("int4", 32, "bfloat16", "cuda")
    assert WeightFormat.of("int8", 32) == WeightFormat("int8", 0, "float32", "cpu")  # a group size is int4's only
    assert WeightFormat.of() == WeightFormat()
    config = ServerConfig(model="m", start=0, end=1, dtype="bfloat16", quant="int4", device="cuda:0")
    assert config.weights == WeightFormat("int4", DEFAULT_GROUP_SIZE, "bfloat16", "cuda")
    assert config.torch_dtype == torch.bfloat16


@pytest.mark.parametrize("fields", [
    {"quant": "int3"}, {"quant": "int4"}, {"quant": "int4", "group_size": 48}, {"quant": "int8", "group_size": 64},
    {"group_size": 64}, {"dtype": "float64"}, {"dtype": "int8"}, {"device": "cuda:0"}, {"device": "tpu"},
])
def test_a_format_the_kernels_or_the_wire_do_not_know_is_refused(fields):
    with pytest.raises(ValueError):
        WeightFormat(**fields)


def test_the_device_decides_the_arithmetic_of_int8_only():
    on_cpu, on_cuda = WeightFormat("int8"), WeightFormat("int8", device="cuda")
    assert on_cpu.arithmetic != on_cuda.arithmetic  # CUDA's int8 multiplies the rows as they are
    for weights in (WeightFormat(), WeightFormat("int4", 64), WeightFormat(dtype="bfloat16")):
        assert dataclasses.replace(weights, device="cuda").arithmetic == weights.arithmetic == weights
    assert WeightFormat(dtype="bfloat16").arithmetic != WeightFormat().arithmetic


def test_labels_say_the_dtype_of_float_weights_and_the_group_of_4_bit_ones():
    assert [f.label for f in (WeightFormat(), WeightFormat(dtype="bfloat16"), WeightFormat("int8"),
                              WeightFormat("int4", 32))] == ["float32", "bfloat16", "int8", "int4/32"]
    assert str(WeightFormat("int4", 64)) == "int4 (groups of 64)"


def test_the_wire_and_the_kernels_take_the_same_lists():
    assert set(DTYPES) == FLOAT_DTYPES  # a record's dtypes are the wire's float dtypes
    assert DEFAULT_GROUP_SIZE in INT4_GROUP_SIZES
    for group_size in INT4_GROUP_SIZES:  # every group size the wire allows, the kernels take
        check_int4_shape(256, 64, group_size)
