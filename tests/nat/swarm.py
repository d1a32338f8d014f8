"""What the NAT tests share: a tiny BLOOM checkpoint, bloompeer processes started in namespaces,
and the reference tokens they must match."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import BloomConfig, BloomForCausalLM

from bloompeer.peer.cli.default_model import write_byte_tokenizer
from bloompeer.peer.cli.local_swarm import PeerProcess

from .netns import NatTopology, TopologyError

__all__ = ["BLOOMPEER", "PAUSED_CLIENT", "NamespacedPeers", "build_topology", "client_result", "deadline", "kill",
           "reference_tokens", "resume", "write_checkpoint"]

BLOOMPEER = [sys.executable, "-m", "bloompeer"]
PAUSED_CLIENT = [sys.executable, str(Path(__file__).with_name("paused_client.py"))]


def deadline(seconds: float = 120.0) -> float:
    return time.monotonic() + seconds


def build_topology(**layout) -> NatTopology:
    """The namespaces, or a test failure saying why not (they need root; CI runs as root)."""
    if os.geteuid() != 0:
        pytest.fail("the NAT tests build network namespaces and need root (CI runs as root)")
    try:
        return NatTopology(**layout).create()
    except TopologyError as exc:
        pytest.fail(f"the kernel or tools refused the test network: {exc}")


def write_checkpoint(directory: Path, hidden: int, layers: int = 2) -> Path:
    vocab = write_byte_tokenizer(directory)
    torch.manual_seed(0)
    config = BloomConfig(vocab_size=vocab, hidden_size=hidden, n_layer=layers, n_head=max(1, hidden // 64),
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    BloomForCausalLM(config).save_pretrained(directory)
    return directory


def reference_tokens(checkpoint: Path, prompt: torch.Tensor, new_tokens: int) -> list[int]:
    model = BloomForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=0)
    return out[0, prompt.shape[1]:].tolist()


class NamespacedPeers:
    """bloompeer processes, each in a namespace of `topology`; stop() ends them all, newest first."""

    def __init__(self, topology: NatTopology, log_dir: Path):
        self.topology, self.log_dir, self.processes = topology, log_dir, []

    def start(self, name: str, role: str, *args: str, program=BLOOMPEER, env: dict[str, str] | None = None
              ) -> PeerProcess:
        process = PeerProcess(name, args, self.log_dir, env, program=[*self.topology.exec_prefix(role), *program])
        self.processes.append(process)
        return process

    def stop(self) -> None:
        for process in reversed(self.processes):
            process.stop()


def client_result(client: PeerProcess, timeout_s: float = 180.0) -> dict:
    """The JSON line paused_client.py prints last."""
    line = client.wait_for_line("{", deadline(timeout_s))
    client.process.wait(timeout=30)
    return json.loads(line)


def resume(go_file: Path) -> None:
    """Let a paused client go on (it waits for this file)."""
    go_file.touch()


def kill(process: PeerProcess) -> None:
    """SIGKILL one peer and its daemon (its process group): as if its machine went away."""
    try:
        os.killpg(process.pid, 9)
    except ProcessLookupError:
        pass
    process.process.wait(timeout=30)


