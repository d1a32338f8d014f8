"""A `bloompeer` command run in a fork (how generate's local swarm starts its peers): its stdout
comes here, its stderr goes to the log, its exit code is the CLI's, and wait() honours a timeout.

In a fresh interpreter: forking refuses to run while other threads exist, as they may in pytest."""

import subprocess
import sys

from bloompeer import __version__

SCRIPT = """
import os, signal, subprocess, sys, tempfile
from bloompeer.peer.cli.forked_cli import ForkedCli

with tempfile.TemporaryFile() as log:
    version = ForkedCli(["--version"], log, {})
    print(repr(version.stdout.read()), version.wait(timeout=60), version.poll())
    refused = ForkedCli(["serve", "--blocks", "4:2"], log, {})
    print(refused.wait(timeout=60))
    log.seek(0)
    print("start < end" in log.read().decode())
    failing = ForkedCli(["dht", "--initial-peers", "/ip4/127.0.0.1/tcp/1/p2p/nobody"], log, {})
    print(failing.wait(timeout=120) != 0)
    # a peer that runs until told to stop: waiting 0 s for it times out, however fast it starts
    waiting = ForkedCli(["dht", "--host-maddrs", "/ip4/127.0.0.1/tcp/0"], log, {})
    assert waiting.stdout.readline().startswith("/ip4/")  # up, its SIGTERM handler set
    try:
        waiting.wait(timeout=0)
    except subprocess.TimeoutExpired:
        print("still running")
    os.kill(waiting.pid, signal.SIGTERM)
    print(waiting.wait(timeout=120))
"""


def test_a_forked_command_reports_its_output_and_exit_code():
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [f"'bloompeer {__version__}\\n' 0 0", "2", "True", "True", "still running", "0"]
