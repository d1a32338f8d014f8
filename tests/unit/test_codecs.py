"""p2p/codecs.py: every codec round-trips within its error, and int8-blockwise decodes a peer's
bytes into the output tensor alone (it makes 4 bytes of float32 per byte received, so each extra
full-size buffer is 4 times the frame)."""

import math
import subprocess
import sys

import pytest
import torch

from bloompeer.p2p import codecs

SIZES = [1, 255, 256, 257, 3 * 256 * 4096 + 77]  # partial blocks, and more than one chunk of blocks


def _blockwise_reference(data: bytes, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """The plain formula: each int8 value times its block's float32 scale, then cast."""
    blocks = math.ceil(numel / codecs.BLOCK)
    scales = torch.frombuffer(bytearray(data[: 4 * blocks]), dtype=torch.float32)
    values = torch.frombuffer(bytearray(data[4 * blocks:]), dtype=torch.int8).float()
    return (values * scales.repeat_interleave(codecs.BLOCK)[:numel]).to(dtype)


@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_int8_blockwise_decodes_to_the_formula(numel, dtype):
    tensor = (torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 3).to(dtype)
    tensor[: min(numel, 300)] *= 1000  # a block of huge values next to ordinary ones
    data = codecs.encode(tensor, "int8-blockwise")
    assert len(data) == codecs.encoded_nbytes("int8-blockwise", numel, dtype)
    decoded = codecs.decode(data, "int8-blockwise", dtype, numel)
    assert decoded.dtype == dtype and decoded.shape == (numel,)
    assert torch.equal(decoded, _blockwise_reference(data, dtype, numel))
    decoded += 1  # writable, and its own memory
    assert torch.equal(codecs.decode(data, "int8-blockwise", dtype, numel), _blockwise_reference(data, dtype, numel))


@pytest.mark.parametrize("codec", sorted(codecs.CODECS))
def test_every_codec_round_trips_within_its_error(codec):
    tensor = torch.randn(3, 1000)
    decoded = codecs.decode(codecs.encode(tensor, codec), codec, tensor.dtype, tensor.numel()).view(3, 1000)
    assert float((decoded - tensor).norm() / tensor.norm()) <= (0.0 if codec == "raw" else 1e-2)


_MEASURE = """
import re, sys, torch
from bloompeer.p2p import codecs

def status(field):
    with open("/proc/self/status") as lines:
        return int(re.search(field + r":\\s+(\\d+) kB", lines.read()).group(1)) << 10

dtype, numel = getattr(torch, sys.argv[1]), 32 << 20
data = torch.ones(numel // codecs.BLOCK).numpy().tobytes() + bytes(numel)  # 32 MiB of int8 values
with open("/proc/self/clear_refs", "w") as clear:
    clear.write("5")  # restart the peak (VmHWM) from the memory in use now
before = status("VmRSS")
decoded = codecs.decode(data, "int8-blockwise", dtype, numel)
print(status("VmHWM") - before, decoded.nbytes)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the peak memory of /proc/self/status")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_int8_blockwise_decoding_makes_one_full_size_buffer(dtype):
    """The peak memory of decoding 32 Mi values (in a fresh process) is the output and small scratch:
    it used to be the output plus two float32 intermediates and two copies of the bytes."""
    result = subprocess.run([sys.executable, "-c", _MEASURE, dtype], capture_output=True, text=True, timeout=120,
                            check=True)
    peak, output = map(int, result.stdout.split())
    assert peak < output + (16 << 20), f"peak {peak >> 20} MiB to decode {output >> 20} MiB"
