"""A `bloompeer` command run in a fork of this process: the real CLI, without a new interpreter.

A fresh interpreter spends seconds importing torch, transformers and hivemind before it does
anything; a fork of a process that has imported them starts at once, sharing their memory. A
local swarm (local_swarm.py) starts its peers this way when its configuration says so.

Forking is safe only before this process has threads or an event loop (the child would inherit
their locks, not their work): the caller forks first, then starts its own threads.

ForkedCli looks like the part of subprocess.Popen that PeerProcess uses: pid, stdout, poll, wait
and returncode.
"""

from __future__ import annotations

import logging
import os
import runpy
import select
import subprocess
import sys
import threading
import traceback
from collections.abc import Sequence
from typing import IO

__all__ = ["ForkedCli", "run_in_child"]


class ForkedCli:
    def __init__(self, args: Sequence[str], stderr: IO, env: dict[str, str]):
        """Run `bloompeer ARGS` in a child: stdout readable here as text lines, stderr into `stderr`,
        `env` added to its environment, in a session of its own (as start_new_session=True)."""
        if threading.active_count() > 1:
            raise RuntimeError(f"cannot fork with other threads running: {threading.enumerate()}")
        read_end, write_end = os.pipe()
        sys.stdout.flush()  # or the child would print what this process had buffered
        sys.stderr.flush()
        self.pid = os.fork()
        if self.pid == 0:
            os.close(read_end)
            run_in_child(args, write_end, stderr.fileno(), env)  # never returns
        os.close(write_end)
        self.stdout = os.fdopen(read_end, "r")
        self.returncode: int | None = None
        self._pidfd = os.pidfd_open(self.pid)

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self._exited(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """The exit code; subprocess.TimeoutExpired if the child runs longer than `timeout` seconds."""
        if self.returncode is None:
            ready, _, _ = select.select([self._pidfd], [], [], timeout)
            if not ready:
                raise subprocess.TimeoutExpired(f"bloompeer (forked, pid {self.pid})", timeout)
            self._exited(os.waitpid(self.pid, 0)[1])
        return self.returncode

    def _exited(self, status: int) -> None:
        self.returncode = os.waitstatus_to_exitcode(status)
        os.close(self._pidfd)


def run_in_child(args: Sequence[str], stdout_fd: int, stderr_fd: int, env: dict[str, str]) -> None:
    """In a just-forked child: run `bloompeer ARGS` with these stdout and stderr, then exit with its code."""
    code = 1
    try:
        os.setsid()
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(stdout_fd, 1)
        os.dup2(stderr_fd, 2)
        os.close(devnull)
        os.close(stdout_fd)
        sys.stdout = open(1, "w", buffering=1, closefd=False)  # fds 1 and 2 now, whatever the parent had
        sys.stderr = open(2, "w", buffering=1, closefd=False)  # replaced them with (pytest's capture, ...)
        os.environ.update(env)
        logging.root.handlers.clear()  # the parent's configuration: cli.main sets up this process's own
        sys.argv = ["bloompeer", *args]
        runpy.run_module("bloompeer", run_name="__main__", alter_sys=True)  # what `python -m bloompeer` runs
        code = 0
    except SystemExit as exc:  # bloompeer/__main__.py exits with cli.main's code
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)  # not the parent's atexit handlers, nor its interpreter teardown
