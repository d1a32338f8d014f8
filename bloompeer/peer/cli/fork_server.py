"""A process that has imported what servers run, and starts `bloompeer` commands as forks of itself.

A process with threads cannot fork itself safely (forked_cli.py), and a new interpreter spends
seconds of CPU importing torch, transformers and hivemind before it does anything. A test session
or a benchmark that starts many peers asks a ForkServer instead: one single-threaded process that
imported them once, and forks a peer per request in milliseconds, the peers sharing its memory.

The peers are the real CLI, as forks of a process that is not their user's; what Popen would give
crosses a Unix socket: the command, its environment and working directory, its stdout pipe and
stderr file (as file descriptors); back comes the peer's pid and, when it ends, its exit code.
Peers stop when the fork server does (EXIT_WITH_PARENT_ENV), and the fork server when its user's
end of the socket closes, however its user died.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import IO

from .forked_cli import run_in_child
from .local_swarm import EXIT_WITH_PARENT_ENV, import_what_servers_run

__all__ = ["ForkServer", "ForkedPeer"]

_MAX_REQUEST_BYTES = 1 << 20


class ForkServer:
    """Start with ForkServer(); launch(args, stderr, env) -> a peer; close() when done (or use `with`)."""

    def __init__(self):
        self._socket, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.process = subprocess.Popen([sys.executable, "-m", __name__, str(theirs.fileno())],
                                        pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, start_new_session=True)
        theirs.close()
        self._lock = threading.Lock()  # one request at a time on the socket (peers start from many threads)

    def launch(self, args: Sequence[str], stderr: IO, env: dict[str, str]) -> ForkedPeer:
        """Run `bloompeer ARGS` as Popen would: stdout readable here, stderr into `stderr`, `env` added
        to this process's environment, in a session of its own. Blocks until the fork server has
        finished its imports (the first time) and forked."""
        read_end, write_end = os.pipe()
        status, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        request = json.dumps({"args": list(args), "env": {**os.environ, **env}, "cwd": os.getcwd()}).encode()
        try:
            with self._lock:
                socket.send_fds(self._socket, [request], [write_end, stderr.fileno(), theirs.fileno()])
        finally:
            os.close(write_end)
            theirs.close()
        return ForkedPeer(status, os.fdopen(read_end, "r"))

    def close(self) -> None:
        """Stop the fork server (its peers then stop too: they SIGTERM themselves)."""
        self._socket.close()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> ForkServer:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


class ForkedPeer:
    """The part of subprocess.Popen that PeerProcess uses: pid, stdout, poll, wait and returncode."""

    def __init__(self, status: socket.socket, stdout: IO):
        self._status, self.stdout = status, stdout
        reply = status.recv(64)
        if not reply:
            raise RuntimeError("the fork server exited before it started the peer")
        self.pid = int(reply)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._status], [], [], 0)[0]:
            self._ended()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """The exit code; subprocess.TimeoutExpired if the peer runs longer than `timeout` seconds."""
        if self.returncode is None:
            if not select.select([self._status], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(f"bloompeer (forked by the fork server, pid {self.pid})", timeout)
            self._ended()
        return self.returncode

    def _ended(self) -> None:
        reply = self._status.recv(64)
        self._status.close()
        if not reply:
            raise RuntimeError(f"the fork server exited before peer {self.pid} did; it stops by itself")
        self.returncode = int(reply)


def _serve(requests: socket.socket) -> None:
    """Fork a peer per request; tell each its exit code; return when the user's end closes."""
    children: dict[int, socket.socket] = {}
    wakeup_read, wakeup_write = os.pipe()
    os.set_blocking(wakeup_write, False)
    signal.set_wakeup_fd(wakeup_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that SIGCHLD reaches the wakeup fd
    import_what_servers_run()
    while True:
        ready = select.select([requests, wakeup_read], [], [])[0]
        if wakeup_read in ready:
            os.read(wakeup_read, 4096)
            _reap(children)
        if requests in ready:
            message, fds, _, _ = socket.recv_fds(requests, _MAX_REQUEST_BYTES, 3)
            if not message:
                return
            pid = _fork(json.loads(message), *fds, children, requests)
            children[pid] = socket.socket(fileno=fds[2])
            _tell(children[pid], pid)


def _fork(request: dict, stdout_fd: int, stderr_fd: int, status_fd: int, children: dict[int, socket.socket],
          requests: socket.socket) -> int:
    pid = os.fork()
    if pid == 0:
        for held in (requests, *children.values()):
            held.close()
        os.close(status_fd)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.chdir(request["cwd"])
        os.environ.clear()
        env = request["env"]
        if EXIT_WITH_PARENT_ENV in env:  # the parent to outlive no longer is the user but this fork server,
            env[EXIT_WITH_PARENT_ENV] = str(os.getppid())  # which exits when its user does
        run_in_child(request["args"], stdout_fd, stderr_fd, env)  # never returns
    os.close(stdout_fd)
    os.close(stderr_fd)
    return pid


def _reap(children: dict[int, socket.socket]) -> None:
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        if (peer := children.pop(pid, None)) is not None:
            _tell(peer, os.waitstatus_to_exitcode(status))
            peer.close()


def _tell(peer: socket.socket, number: int) -> None:
    with contextlib.suppress(OSError):  # its user may have gone without waiting for it
        peer.send(str(number).encode())


if __name__ == "__main__":
    _serve(socket.socket(fileno=int(sys.argv[1])))
