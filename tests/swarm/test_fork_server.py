"""The fork server starts the real CLI as it would run on its own: stdout, stderr, exit code,
environment and signals reach whoever launched it, and nothing outlives the fork server."""

import contextlib
import os
import select
import signal
import time

import pytest

from bloompeer.peer.cli.fork_server import ForkServer
from bloompeer.peer.cli.flags import INITIAL_PEERS_ENV
from bloompeer.peer.cli.local_swarm import PeerProcess


@pytest.fixture
def fork_server():
    server = ForkServer()
    yield server
    server.close()


def test_a_command_gets_its_stdout_stderr_and_exit_code_back(fork_server, tmp_path):
    with open(tmp_path / "help.err", "wb") as stderr:
        helped = fork_server.launch(["serve", "--help"], stderr, {})
        assert "--blocks" in helped.stdout.read() and helped.wait(timeout=60) == 0
    with open(tmp_path / "bad.err", "wb") as stderr:
        refused = fork_server.launch(["serve", "--blocks", "0:1", "--no-such-flag"], stderr, {})
        assert refused.wait(timeout=60) == 2
    assert "unrecognized arguments: --no-such-flag" in (tmp_path / "bad.err").read_text()


def test_a_peer_gets_the_launchers_directory_environment_and_signals(fork_server, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    bootstrap = PeerProcess("bootstrap", ["dht", "--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--maddrs-file", "peers"],
                            tmp_path, launch=fork_server.launch)
    try:
        maddr = bootstrap.wait_for_line("/ip4/127.0.0.1/", time.monotonic() + 60)
        assert (tmp_path / "peers").read_text().splitlines()[0] == maddr  # relative to the launcher's directory
        os.kill(bootstrap.pid, signal.SIGTERM)  # the pid is the peer's own
        assert bootstrap.process.wait(timeout=30) == 0
    finally:
        bootstrap.stop()
    # set after the fork server started, it arrives all the same: `status` fails on that peer, gone now
    monkeypatch.setenv(INITIAL_PEERS_ENV, maddr)
    with open(tmp_path / "status.err", "wb") as stderr:
        status = fork_server.launch(["status"], stderr, {})
        assert status.wait(timeout=60) == 1
    assert "could not start the libp2p daemon" in (tmp_path / "status.err").read_text()


def test_peers_stop_when_their_fork_server_does(fork_server, tmp_path):
    bootstrap = PeerProcess("bootstrap", ["dht", "--host-maddrs", "/ip4/127.0.0.1/tcp/0"], tmp_path,
                            launch=fork_server.launch)
    try:
        bootstrap.wait_for_line("/ip4/127.0.0.1/", time.monotonic() + 60)
        fork_server.close()
        with pytest.raises(RuntimeError, match="fork server exited"):
            bootstrap.process.wait(timeout=30)
        pidfd = os.pidfd_open(bootstrap.pid)  # not our child: watched through a pidfd
        try:
            assert select.select([pidfd], [], [], 30)[0], "the peer outlived its fork server"
        finally:
            os.close(pidfd)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(bootstrap.pid, signal.SIGKILL)
