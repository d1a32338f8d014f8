"""A swarm on this machine: a bootstrap peer and servers as child processes on 127.0.0.1.

Used by `bloompeer generate` when no swarm is given, by the tests and by the benchmarks. The
processes are the real CLI; readiness is the line each prints ("/ip4/..." for the bootstrap
peer, "online" for a server), never a sleep. Children get SIGTERM if this process dies.

LocalSwarmConfig() starts every peer as `bloompeer` would on its own (what tests exercise);
ONE_COMMAND_SWARM takes the shortcuts that a swarm living for one command on one machine can,
each one named there.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from ...errors import BloompeerError
from .forked_cli import ForkedCli
from .import_gc import imports_without_gc
from .local_config import local_num_model_blocks

__all__ = [
    "EXIT_WITH_PARENT_ENV", "Launch", "LocalSwarm", "LocalSwarmConfig", "ONE_COMMAND_SWARM", "ProcessFailed",
    "PeerProcess", "import_what_servers_run", "num_model_blocks_of", "split_blocks", "start_local_swarm",
    "stop_in_parallel",
]

logger = logging.getLogger(__name__)

LOOPBACK = "/ip4/127.0.0.1/tcp/0"
BLOOMPEER_COMMAND = (sys.executable, "-m", "bloompeer")
EXIT_WITH_PARENT_ENV = "BLOOMPEER_EXIT_WITH_PARENT"  # the child's cli.main arranges a SIGTERM when we die

# Starts `bloompeer ARGS` with stderr into a file and these variables added to the environment; returns
# what PeerProcess uses of a Popen (pid, stdout, poll, wait, returncode): ForkedCli, ForkServer.launch
Launch = Callable[[Sequence[str], IO, dict[str, str]], Any]


class ProcessFailed(BloompeerError, RuntimeError):
    """A peer process exited or stayed silent before it was ready; the message ends with its log's tail."""


@dataclass(frozen=True)
class LocalSwarmConfig:
    """How a local swarm starts its peers. The defaults run them as `bloompeer dht` and
    `serve` run anywhere (what the tests exercise); every other value is a shortcut that only a
    swarm on one machine, living for one command, can take."""

    fork: bool = False  # the peers are forks of this process (imports done once, shared), not new interpreters
    relay: bool = True  # the bootstrap peer relays for peers behind NAT (on one machine there are none)
    check_reachability: bool = True  # servers ask the bootstrap peer to dial them back (on loopback all can)
    quick_throughput: bool = False  # servers estimate their throughput in a few steps and keep it nowhere

    def bootstrap_args(self) -> list[str]:
        return [] if self.relay else ["--no-relay"]

    def server_args(self) -> list[str]:
        return [*([] if self.check_reachability else ["--no-reachability-check"]),
                *(["--quick-throughput"] if self.quick_throughput else [])]


# `bloompeer generate` with no swarm given (fork: where os.fork and pidfd_open are there and safe enough)
ONE_COMMAND_SWARM = LocalSwarmConfig(fork=sys.platform == "linux", relay=False, check_reachability=False,
                                     quick_throughput=True)


def split_blocks(num_model_blocks: int, num_servers: int) -> list[tuple[int, int]]:
    """Contiguous, nearly equal ranges: split_blocks(5, 2) == [(0, 3), (3, 5)]."""
    bounds = [round(i * num_model_blocks / num_servers) for i in range(num_servers + 1)]
    return [(start, end) for start, end in zip(bounds, bounds[1:]) if start < end]


def num_model_blocks_of(model: str | Path) -> int:
    """How many blocks a model has: from a local config.json (without importing torch), else its checkpoint."""
    if (num_model_blocks := local_num_model_blocks(model)) is not None:
        return num_model_blocks
    from ...blocks import open_checkpoint

    return open_checkpoint(str(model)).config().num_hidden_layers


class PeerProcess:
    """One `bloompeer` child process, its stdout lines and its stderr log file.

    launch: start the CLI with it instead of running `program` (ForkedCli: as a fork of this process;
    a ForkServer's launch: as a fork of that one).
    read_now=False: no thread reads stdout until start_reading() (this process may still fork);
    until then wait_for_line reads in the calling thread."""

    def __init__(self, name: str, args: Sequence[str], log_dir: Path, env: dict[str, str] | None = None,
                 program: Sequence[str] = BLOOMPEER_COMMAND, launch: Launch | None = None, read_now: bool = True):
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "wb")
        env = {EXIT_WITH_PARENT_ENV: str(os.getpid()), **(env or {})}
        if launch is not None:
            self.process = launch(args, self._log, env)
        else:
            self.process = subprocess.Popen([*program, *args], stdout=subprocess.PIPE, stderr=self._log, text=True,
                                            env={**os.environ, **env}, start_new_session=True)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.online_line: str | None = None
        self.stdout: list[str] = []
        self._reading = False
        if read_now:
            self.start_reading()

    def start_reading(self) -> None:
        """Read stdout lines in a thread from now on (into `lines` and `stdout`)."""
        if not self._reading:
            self._reading = True
            threading.Thread(target=self._read_stdout, name=f"{self.name}-stdout", daemon=True).start()

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
                line = self._next_line(deadline)
            except TimeoutError:
                raise ProcessFailed(f"{self.name} printed no {prefix!r} line in time\n{self.log_tail()}") from None
            if line is None:
                raise ProcessFailed(f"{self.name} exited with code {self.process.wait()}\n{self.log_tail()}")
            if line.startswith(prefix):
                return line

    def _next_line(self, deadline: float) -> str | None:
        """The next stdout line (None at its end), from the reading thread or, before it runs, read here."""
        if self._reading:
            try:
                return self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError from None
        fd, line = self.process.stdout.fileno(), bytearray()
        while True:  # byte by byte, so that nothing is left in a buffer that the thread would not see
            if not select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
                raise TimeoutError
            byte = os.read(fd, 1)
            if not byte:
                return None
            if byte == b"\n":
                self.stdout.append(line.decode())
                return self.stdout[-1]
            line += byte

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
        if not self._log.closed:  # closed once the process is stopped; the file stays
            self._log.flush()
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(f"  {self.name}| {line}" for line in text[-lines:])

    def wait_exit(self, timeout_s: float) -> int:
        """The exit code; ProcessFailed, with the log's tail, if the process still runs after `timeout_s`."""
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise ProcessFailed(f"{self.name} still runs after {timeout_s:.0f} s\n{self.log_tail()}") from None

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
                 log_dir: str | Path | None = None, start_timeout_s: float = 120.0,
                 config: LocalSwarmConfig = LocalSwarmConfig(), launch: Launch | None = None):
        """launch: how peers start unless config.fork has this process fork them (default: as new
        interpreters; a ForkServer's launch where many peers start, as in the tests)."""
        self.model, self.spans, self.server_args = str(model), list(spans), list(server_args)
        self.start_timeout_s, self.config, self.launch = start_timeout_s, config, launch
        self._tmp = None if log_dir is not None else tempfile.TemporaryDirectory(prefix="bloompeer-swarm-")
        self.log_dir = Path(log_dir if log_dir is not None else self._tmp.name)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.bootstrap: PeerProcess | None = None
        self.servers: list[PeerProcess] = []
        self.initial_peers: list[str] = []
        self._deadline = float("inf")  # for the servers that start() started

    def start(self, wait_online: bool = True) -> LocalSwarm:
        """Start the bootstrap peer (and wait for it), then the servers; wait for them too unless told not
        to (then call wait_online). Forking needs a process without other threads (see forked_cli.py);
        with any running, the peers start as new processes instead."""
        fork = self.config.fork and threading.active_count() == 1
        if self.config.fork and not fork:
            logger.debug("Other threads run here (%s): starting the peers as new processes, not forks",
                         ", ".join(thread.name for thread in threading.enumerate()))
        try:
            deadline = time.monotonic() + self.start_timeout_s
            self.bootstrap = PeerProcess("bootstrap", ["dht", "--host-maddrs", LOOPBACK, *self.config.bootstrap_args()],
                                         self.log_dir, launch=ForkedCli if fork else self.launch, read_now=not fork)
            if fork:
                import_what_servers_run()  # while the bootstrap peer starts
            self.initial_peers = [self.bootstrap.wait_for_line("/", deadline)]
            for start, end in self.spans:  # all servers start in parallel
                self.servers.append(self._server_process(start, end, fork=fork))
            for peer in (self.bootstrap, *self.servers):
                peer.start_reading()
            self._deadline = deadline
            if wait_online:
                self.wait_online()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_online(self) -> None:
        """Wait until every server started by start() is online (ProcessFailed if one is not in time)."""
        for server in self.servers[:len(self.spans)]:
            if server.online_line is None:
                server.wait_online(self._deadline)

    def add_server(self, start: int | None, end: int | None, extra_args: Sequence[str] = (), wait: bool = True,
                   name: str | None = None, env: dict[str, str] | None = None,
                   model: str | Path | None = None, program: Sequence[str] | None = None) -> PeerProcess:
        """Start one more server (of another model if `model` is given) and, by default, wait for it.

        With start and end None, pass the choice of blocks in `extra_args` (--num-blocks K).
        """
        server = self._server_process(start, end, extra_args, name, env, model, program)
        self.servers.append(server)
        if wait:
            server.wait_online(time.monotonic() + self.start_timeout_s)
        return server

    def _server_process(self, start: int | None, end: int | None, extra_args: Sequence[str] = (),
                        name: str | None = None, env: dict[str, str] | None = None, model: str | Path | None = None,
                        program: Sequence[str] | None = None, fork: bool = False) -> PeerProcess:
        blocks = [] if start is None else ["--blocks", f"{start}:{end}"]
        args = ["serve", "--model", str(model or self.model), *blocks, "--host-maddrs", LOOPBACK, "--no-relay",
                "--initial-peers", *self.initial_peers, *self.config.server_args(), *self.server_args, *extra_args]
        launch = ForkedCli if fork else None if program else self.launch
        return PeerProcess(name or f"server{len(self.servers)}-{start}-{end}", args, self.log_dir, env,
                           program or BLOOMPEER_COMMAND, launch=launch, read_now=not fork)

    def stop(self) -> None:
        """Stop every process (servers first, in parallel), SIGKILLing any that hang."""
        stop_in_parallel(self.servers)
        if self.bootstrap is not None:
            self.bootstrap.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> LocalSwarm:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        self.stop()


def stop_in_parallel(peers: Sequence[PeerProcess]) -> None:
    """SIGTERM all of them at once, then stop each (waiting, SIGKILLing any that hang): a server
    takes a while to say goodbye on the DHT, and they need not take turns."""
    for peer in peers:
        if peer.process.poll() is None:
            peer.signal(signal.SIGCONT)  # a stopped process would not act on SIGTERM
            peer.signal(signal.SIGTERM)
    for peer in peers:
        peer.stop()


def start_local_swarm(model_path: str, stack: contextlib.ExitStack, log_dir: str | None = None,
                      wait_online: bool = True, num_servers: int = 2) -> LocalSwarm:
    """For a client command given no peers: a one-command local swarm of the model (ONE_COMMAND_SWARM),
    stopped when `stack` closes. Its bootstrap peer is up on return; its servers too, unless
    `wait_online` is False (then call its wait_online() once the client is ready)."""
    spans = split_blocks(num_model_blocks_of(model_path), num_servers)
    logger.info("No --initial-peers given: starting a local swarm (a bootstrap peer and servers for blocks %s)",
                ", ".join(f"{start}:{end}" for start, end in spans))
    swarm = LocalSwarm(model_path, spans, log_dir=log_dir, config=ONE_COMMAND_SWARM)
    stack.callback(swarm.stop)
    return swarm.start(wait_online=wait_online)


def import_what_servers_run() -> None:
    """Import the server's modules (torch, transformers, hivemind) once, here, for the forks to share."""
    with imports_without_gc():
        import uvloop  # noqa: F401  (cli.main runs the server in it)

        from ..server import server  # noqa: F401
