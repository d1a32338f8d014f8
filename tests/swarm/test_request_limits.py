"""A request no server can ever take fails at once, naming the limit; no server is banned for it.

Servers announce their request limits in their signed records; routing never picks a server
that would have to refuse, and when none in the swarm can take a request it is the request
that is wrong, not the swarm.
"""

import subprocess
import sys

import pytest
import torch

from bloompeer.peer.client.errors import RequestTooLargeError

from .conftest import swarm_client

PROMPT = torch.tensor([[1, 60, 61, 62, 63, 64]])


@pytest.fixture
def short_servers(start_servers):
    """Servers (one of the whole model, one of blocks 2:4) that hold at most 64 tokens a session."""
    return start_servers([(0, 4), (2, 4)], "--max-length", "64")


@torch.inference_mode()
def test_a_request_over_every_servers_limit_fails_at_once_and_the_next_one_works(
        short_servers, swarm, fresh_model, reference_model):
    with swarm_client(swarm, fresh_model, missing_blocks_timeout_s=30.0, recovery_timeout_s=30.0) as model:
        with pytest.raises(RequestTooLargeError) as raised:
            model.generate(PROMPT, max_new_tokens=200, do_sample=False)
        message = str(raised.value)
        assert "tokens per session (prompt and new tokens) 205 is over the limit of every server of block 0" in message
        assert "largest on offer is 64" in message and "--max-length" in message
        assert model.client.swarm.bans.banned() == set()
        ours = model.generate(PROMPT, max_new_tokens=20, do_sample=False)  # fits: served at once, same servers
        assert model.client.swarm.bans.banned() == set()
    assert ours.tolist() == reference_model.generate(PROMPT, max_new_tokens=20, do_sample=False).tolist()


def test_the_cli_says_so_in_one_line(short_servers, swarm, fresh_model):
    result = subprocess.run(
        [sys.executable, "-m", "bloompeer", "generate", "x", "--model", str(fresh_model), "--max-new-tokens", "300",
         "--initial-peers", *swarm.initial_peers], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if "cannot be served" in line]
    assert len(errors) == 1 and "largest on offer is 64" in errors[0], result.stderr
    assert "Traceback" not in result.stderr
