"""The client's own copy of some blocks, for checking servers, loaded once however many checks need
them at the same time (each check runs on an executor thread)."""

from __future__ import annotations

import threading

import torch

from bloompeer.blocks import open_checkpoint
from bloompeer.blocks.quantized_linear import Int8Linear
from bloompeer.peer.client.verification import LocalBlocks
from bloompeer.weight_format import WeightFormat

HOLD_S = 2.0  # how long the first load waits for a second one to start (none does, once loads are locked)


class CountedCheckpoint:
    """load_span counts its loads; the first waits until a second load begins, or HOLD_S: time for a
    second thread needing the same blocks to load them too, if nothing stops it."""

    def __init__(self):
        self.loads, self.loading, self.second_load = 0, threading.Event(), threading.Event()

    def load_span(self, start: int, end: int, dtype: torch.dtype, prepare_block=None):
        self.loads += 1
        if self.loads == 1:
            self.loading.set()
            self.second_load.wait(HOLD_S)
        else:
            self.second_load.set()
        return lambda hidden, padding_mask, prompts=None: hidden * 2


def test_two_checks_needing_the_same_blocks_at_once_load_them_once():
    checkpoint = CountedCheckpoint()
    local = LocalBlocks(checkpoint)
    outputs = {}

    def check(name: str) -> None:
        outputs[name] = local.forward(0, 2, torch.ones(1, 3, 4), None, None)

    first = threading.Thread(target=check, args=("first",))
    first.start()
    assert checkpoint.loading.wait(30)
    second = threading.Thread(target=check, args=("second",))
    second.start()
    first.join(30)
    second.join(30)

    assert checkpoint.loads == 1
    for output in outputs.values():
        torch.testing.assert_close(output, torch.full((1, 3, 4), 2.0))
    assert set(outputs) == {"first", "second"}


def test_int8_blocks_compute_as_the_checked_servers_device_does(tiny_checkpoint):
    """CUDA's int8 arithmetic differs from the CPU's by up to verification's tolerance (weight_format.py):
    the client recomputes a CUDA server's span CUDA's way, and a CPU server's the CPU's."""
    local = LocalBlocks(open_checkpoint(tiny_checkpoint))
    hidden = torch.randn(1, 3, 64)
    for device, cuda_arithmetic in [("cuda", True), ("cpu", False)]:
        arithmetic = WeightFormat("int8", device=device)
        local.forward(0, 2, hidden, None, None, arithmetic)
        layers = [m for m in local._spans[(0, 2, arithmetic)].modules() if isinstance(m, Int8Linear)]
        assert layers and all(layer.cuda_arithmetic == cuda_arithmetic for layer in layers)
