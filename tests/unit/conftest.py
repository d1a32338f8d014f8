"""Fixtures for the server's parts without processes or network: a two-block span and a compute thread."""

import pytest
import torch
from transformers import BloomConfig

from bloompeer.blocks.bloom import BloomSpan
from bloompeer.peer.server.compute import ComputeWorker

SPAN_CONFIG = BloomConfig(vocab_size=100, hidden_size=32, n_layer=2, n_head=4)


@pytest.fixture(scope="module")
def span():
    torch.manual_seed(0)
    return BloomSpan(SPAN_CONFIG, 0, 2).eval().requires_grad_(False)


@pytest.fixture
def compute():
    worker = ComputeWorker()
    yield worker
    worker.shutdown()
