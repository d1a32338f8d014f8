"""benchmarks/qwen3_next.py at toy sizes, on the session's bootstrap peer: two servers of the tiny Qwen3-Next
checkpoint, sessions shorter and longer than the 64-token chunk. Its timings are printed, never asserted; what is
asserted is what the benchmark's figures rest on: greedy tokens equal transformers', and a session's cache (the
tensors a SessionCache allocates, and the servers' own cache_bytes_used gauge) equals the bytes expected from the
shapes, its Gated DeltaNet share the same at both lengths."""

import argparse
import shutil

import torch

from benchmarks.qwen3_next import TINY_LENGTHS, expected_total, print_tables, run

PLACEMENT = [(0, 2), (2, 4)]


@torch.inference_mode()
def test_qwen3_next_benchmark_runs_at_toy_sizes(swarm, qwen3_next_checkpoint, tmp_path):
    path = tmp_path / "qwen3-next-bench"
    shutil.copytree(qwen3_next_checkpoint, path)  # a model of its own: no other test's servers serve it
    results = run(swarm, path, PLACEMENT, TINY_LENGTHS, argparse.Namespace(rounds=1, steps=2))
    print_tables(results, path, PLACEMENT)
    for length, figures in results.items():
        expected = expected_total(path, PLACEMENT, length)
        assert figures.tokens_equal, length
        assert figures.cache == expected, length
        assert figures.gauge == sum(expected.values()), length
        assert len(figures.verify) == len(figures.after_rejection) == len(figures.local_verify) == 1
    short, long = (results[length].cache for length in TINY_LENGTHS)
    assert short["deltanet"] == long["deltanet"] > 0 and long["attention"] > short["attention"]
