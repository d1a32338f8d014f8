"""A swarm on this machine: a bootstrap peer and servers as child processes on 127.0.0.1.

Used by `bloompeer generate` when no swarm is given, by the tests and by the benchmarks. The
processes are the real CLI; readiness is the line each prints ("/ip4/..." for the bootstrap
peer, "online" for a server), never a sleep. Children get SIGTERM if this process dies.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from ..errors import BloompeerError

__all__ = [
    "EXIT_WITH_PARENT_ENV", "LocalSwarm", "ProcessFailed", "PeerProcess", "split_blocks", "start_local_swarm",
]

logger = logging.getLogger(__name__)

LOOPBACK = "/ip4/127.0.0.1/tcp/0"
BLOOMPEER_COMMAND = (sys.executable, "-m", "bloompeer")
EXIT_WITH_PARENT_ENV = "BLOOMPEER_EXIT_WITH_PARENT"  # the child's cli.main arranges a SIGTERM when we die


class ProcessFailed(BloompeerError, RuntimeError):
    """A peer process exited or stayed silent before it was ready; the message ends with its log's tail."""


def split_blocks(num_blocks: int, num_servers: int) -> list[tuple[int, int]]:
    """Contiguous, nearly equal ranges: split_blocks(5, 2) == [(0, 3), (3, 5)]."""
    bounds = [round(i * num_blocks / num_servers) for i in range(num_servers + 1)]
    return [(start, end) for start, end in zip(bounds, bounds[1:]) if start < end]


class PeerProcess:
    """One `bloompeer` child process, its stdout lines and its stderr log file."""

    def __init__(self, name: str, args: Sequence[str], log_dir: Path, env: dict[str, str] | None = None,
                 program: Sequence[str] = BLOOMPEER_COMMAND):
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen(
            [*program, *args], stdout=subprocess.PIPE, stderr=self._log, text=True,
            env={**os.environ, EXIT_WITH_PARENT_ENV: str(os.getpid()), **(env or {})}, start_new_session=True,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.online_line: str | None = None
        self.stdout: list[str] = []
        threading.Thread(target=self._read_stdout, name=f"{name}-stdout", daemon=True).start()

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def peer_id_str(self) -> str:
        """From the first multiaddr the peer printed (".../p2p/<peer id>")."""
        maddr = next(line for line in self.stdout if line.startswith("/"))
        return maddr.rsplit("/p2p/", 1)[1]

    def _read_stdout(self) -> None:
        for line in self.process.stdout:
            self.stdout.append(line.rstrip("\n"))
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def wait_for_line(self, prefix: str, deadline: float) -> str:
        """The first stdout line starting with `prefix`; raises ProcessFailed on exit or at the deadline."""
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise ProcessFailed(f"{self.name} printed no {prefix!r} line in time\n{self.log_tail()}") from None
            if line is None:
                raise ProcessFailed(f"{self.name} exited with code {self.process.wait()}\n{self.log_tail()}")
            if line.startswith(prefix):
                return line

    def wait_online(self, deadline: float) -> str:
        """Wait for a server's "online: serving <model> blocks A:B as <peer id>" line."""
        self.online_line = self.wait_for_line("online", deadline)
        return self.online_line

    @property
    def blocks(self) -> tuple[int, int]:
        """The blocks a server said it serves, from its online line."""
        start, end = self.online_line.split(" blocks ", 1)[1].split()[0].split(":")
        return int(start), int(end)

    def log_tail(self, lines: int = 30) -> str:
        self._log.flush()
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(f"  {self.name}| {line}" for line in text[-lines:])

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, sig)

    def stop(self, timeout_s: float = 15.0) -> int:
        """SIGTERM, wait, then SIGKILL by PID. Returns the exit code."""
        if self.process.poll() is None:
            self.signal(signal.SIGCONT)  # a stopped process would not act on SIGTERM
            self.signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("%s did not stop within %.0f s; killing it", self.name, timeout_s)
                self.signal(signal.SIGKILL)
                self.process.wait()
        self._log.close()
        return self.process.returncode


class LocalSwarm:
    """A bootstrap peer plus one server per block range, all on 127.0.0.1.

        with LocalSwarm(model_dir, [(0, 2), (2, 4)]) as swarm:
            ... swarm.initial_peers ...
    """

    def __init__(self, model: str, spans: Sequence[tuple[int, int]], server_args: Sequence[str] = (),
                 log_dir: str | Path | None = None, start_timeout_s: float = 120.0):
        self.model, self.spans, self.server_args = str(model), list(spans), list(server_args)
        self.start_timeout_s = start_timeout_s
        self._tmp = None if log_dir is not None else tempfile.TemporaryDirectory(prefix="bloompeer-swarm-")
        self.log_dir = Path(log_dir if log_dir is not None else self._tmp.name)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.bootstrap: PeerProcess | None = None
        self.servers: list[PeerProcess] = []
        self.initial_peers: list[str] = []

    def start(self) -> LocalSwarm:
        try:
            deadline = time.monotonic() + self.start_timeout_s
            self.bootstrap = PeerProcess("bootstrap", ["dht", "--host-maddrs", LOOPBACK], self.log_dir)
            self.initial_peers = [self.bootstrap.wait_for_line("/", deadline)]
            for start, end in self.spans:  # all servers start in parallel
                self.add_server(start, end, wait=False)
            for server in self.servers:
                server.wait_online(deadline)
        except BaseException:
            self.stop()
            raise
        return self

    def add_server(self, start: int | None, end: int | None, extra_args: Sequence[str] = (), wait: bool = True,
                   name: str | None = None, env: dict[str, str] | None = None,
                   model: str | Path | None = None, program: Sequence[str] | None = None) -> PeerProcess:
        """Start one more server (of another model if `model` is given) and, by default, wait for it.

        With start and end None, pass the choice of blocks in `extra_args` (--num-blocks K).
        """
        blocks = [] if start is None else ["--blocks", f"{start}:{end}"]
        args = ["serve", "--model", str(model or self.model), *blocks, "--host-maddrs", LOOPBACK, "--no-relay",
                "--initial-peers", *self.initial_peers, *self.server_args, *extra_args]
        server = PeerProcess(name or f"server{len(self.servers)}-{start}-{end}", args, self.log_dir, env,
                             program or BLOOMPEER_COMMAND)
        self.servers.append(server)
        if wait:
            server.wait_online(time.monotonic() + self.start_timeout_s)
        return server

    def stop(self) -> None:
        """Stop every process (servers first, in parallel), SIGKILLing any that hang."""
        for server in self.servers:
            if server.process.poll() is None:
                server.signal(signal.SIGTERM)
        for server in self.servers:
            server.stop()
        if self.bootstrap is not None:
            self.bootstrap.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> LocalSwarm:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()


def start_local_swarm(model_path: str, stack: contextlib.ExitStack, num_servers: int = 2) -> tuple[str, ...]:
    """For a client command given no peers: a local swarm of the model, stopped when `stack` closes;
    its initial peers."""
    from ..blocks import open_checkpoint

    spans = split_blocks(open_checkpoint(model_path).config().n_layer, num_servers)
    logger.info("No --initial-peers given: starting a local swarm (a bootstrap peer and servers for blocks %s)",
                ", ".join(f"{start}:{end}" for start, end in spans))
    swarm = stack.enter_context(LocalSwarm(model_path, spans))
    return tuple(swarm.initial_peers)
