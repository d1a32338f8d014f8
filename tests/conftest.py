"""Shared fixtures: tiny random BLOOM checkpoints written to temp dirs (tests never download)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import BloomForCausalLM

from bloompeer.peer.default_model import write_random_checkpoint

TINY_BLOCKS = 4


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    """A 4-block BLOOM (hidden 64) with a byte-level tokenizer, sharded over many small files."""
    return write_random_checkpoint(tmp_path_factory.mktemp("tiny-bloom"), num_blocks=TINY_BLOCKS, hidden_size=64,
                                   num_heads=4, seed=1, max_shard_size="40KB")


@pytest.fixture(scope="session")
def reference_model(tiny_checkpoint) -> BloomForCausalLM:
    """transformers' own BLOOM on the same weights: the numeric reference."""
    return BloomForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
