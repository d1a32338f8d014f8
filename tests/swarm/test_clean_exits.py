"""Every bloompeer process ends the same way every time: its work done, exit status 0, nothing left.

Races at exit show up only now and then (a daemon dying with our process group before we said
goodbye to it; loop threads still running while the interpreter tears down), so each case is run
several times, some at once, and every exit status is checked.
"""

import os
import signal
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import torch

from .conftest import MARKER_ENV, processes_with_env

RUNS = 4
AT_ONCE = 2

CLIENT_SCRIPT = """
import sys, torch
from bloompeer import DistributedBloomForCausalLM
model = DistributedBloomForCausalLM.from_pretrained(sys.argv[1], initial_peers=sys.argv[2:])
tokens = model.generate(torch.tensor([[1, 60, 61, 62]]), max_new_tokens=6, do_sample=False)
print(tokens.tolist())
"""


def test_client_scripts_exit_cleanly_every_time(swarm, tiny_checkpoint, reference_model):
    """A short client script that never calls shutdown() (as scripts do), run several times, some at
    once: each prints the right tokens and exits 0, leaving nothing running."""
    with torch.inference_mode():
        expected = reference_model.generate(torch.tensor([[1, 60, 61, 62]]), max_new_tokens=6, do_sample=False)
    marker = uuid.uuid4().hex
    script = CLIENT_SCRIPT
    env = {**os.environ, MARKER_ENV: marker}

    def run(_):
        return subprocess.run([sys.executable, "-c", script, str(tiny_checkpoint), *swarm.initial_peers],
                              capture_output=True, text=True, env=env, timeout=180)

    with ThreadPoolExecutor(AT_ONCE) as pool:
        results = list(pool.map(run, range(RUNS)))
    for result in results:
        assert result.returncode == 0, f"exit status {result.returncode}\n{result.stderr[-3000:]}"
        assert result.stdout.strip() == str(expected.tolist())
    assert processes_with_env(MARKER_ENV, marker) == []


def test_servers_stop_by_group_sigterm_every_time(swarm):
    """SIGTERM to each server's whole process group (what Ctrl-C in a terminal, or systemd, does):
    the daemon dies at the same moment as the server; every server still exits 0 with no error."""
    marker = uuid.uuid4().hex
    servers = [swarm.add_server(0, 1, name=f"group-term-{i}", wait=False, env={MARKER_ENV: marker})
               for i in range(RUNS)]
    deadline = time.monotonic() + 120
    for server in servers:
        server.wait_online(deadline)
    for server in servers:
        os.killpg(server.pid, signal.SIGTERM)
    for server in servers:
        assert server.wait_exit(60) == 0, server.log_tail()
        log = server.log_path.read_text()  # (p2pd's own complaints as it dies are not ours: "ERROR hivemind...")
        assert " ERROR bloompeer" not in log and "Traceback" not in log, server.log_tail()
    assert processes_with_env(MARKER_ENV, marker) == []


def test_a_server_whose_daemon_hangs_still_stops_on_sigterm(swarm):
    """Its p2pd frozen (SIGSTOP: connections to it open, nothing ever answers, SIGTERM stays pending),
    a server told to stop gives each step of its shutdown a bounded time, kills the daemon, and
    exits 0 with nothing left running."""
    marker = uuid.uuid4().hex
    server = swarm.add_server(0, 1, ["--drain-timeout", "1"], name="hung-daemon", env={MARKER_ENV: marker})
    daemons = [pid for pid in processes_with_env(MARKER_ENV, marker) if pid != server.pid]
    assert daemons, "the server's p2pd carries the marker in its environment"
    try:
        for pid in daemons:
            os.kill(pid, signal.SIGSTOP)
        server.signal(signal.SIGTERM)
        assert server.wait_exit(60) == 0, server.log_tail()
        assert "did not exit within 3 s of SIGTERM; killing it" in server.log_path.read_text(), server.log_tail()
        assert processes_with_env(MARKER_ENV, marker) == []
    finally:  # the swarm's teardown stops the server; its frozen daemon is ours to kill
        for pid in processes_with_env(MARKER_ENV, marker):
            os.kill(pid, signal.SIGKILL)


def test_a_server_without_a_drain_goes_straight_to_offline(swarm):
    """--drain-timeout 0: no draining announced, nothing waited for, no warning about it."""
    server = swarm.add_server(0, 1, ["--drain-timeout", "0"], name="no-drain")
    server.signal(signal.SIGTERM)
    assert server.wait_exit(60) == 0, server.log_tail()
    log = server.log_path.read_text()
    assert "Drained" not in log and "announcing draining" not in log, server.log_tail()
