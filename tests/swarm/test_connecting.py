"""from_pretrained joins the swarm while it loads the checkpoint's tensors (SwarmClient.start_connecting):
when the loading fails, what the joining started is released, not left running."""

import json
import os
import shutil
import threading
from pathlib import Path

import pytest
from .conftest import swarm_client


def _child_daemons() -> list[int]:
    """PIDs of live p2pd processes that this process started."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            comm = (proc / "comm").read_text().strip()
            fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if comm == "p2pd" and int(fields[1]) == os.getpid() and fields[0] != "Z":
            pids.append(int(proc.name))
    return pids


def _client_threads() -> list[str]:
    return [thread.name for thread in threading.enumerate() if thread.name == "bloompeer-client"]


def test_a_checkpoint_that_fails_to_load_leaves_no_daemon_or_loop(swarm, tiny_checkpoint, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_checkpoint, broken)
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    embeddings_shard = broken / index["weight_map"]["transformer.word_embeddings.weight"]
    embeddings_shard.write_bytes(embeddings_shard.read_bytes()[:100])  # cut short: not a safetensors file any more
    threads, daemons = _client_threads(), _child_daemons()
    with pytest.raises(Exception):
        swarm_client(swarm, broken)
    assert _client_threads() == threads and _child_daemons() == daemons

