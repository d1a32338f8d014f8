"""Containers of the built image, run the way `docker run` would, with buildah's chroot isolation.

Chroot isolation shares the host's network and process namespaces: a container's processes are
host processes (found by a marker in their environment, which the container's children inherit),
and its peers listen on the host's 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

from bloompeer.peer.cli.local_swarm import PeerProcess
from tests.swarm.conftest import MARKER_ENV, processes_with_env

__all__ = ["Container", "image_config"]

BUILDAH_RUN = ("buildah", "run", "--isolation", "chroot")


def image_config(image: str) -> dict:
    """The image's OCI config and history (`buildah inspect`)."""
    inspected = subprocess.run(["buildah", "inspect", "--type", "image", image], capture_output=True, text=True,
                               check=True)
    return json.loads(inspected.stdout)["OCIv1"]


class Container:
    """A working container of `image` (`buildah from`); commands run in it as the image's user.
    close() kills whatever still runs in it, by PID, and removes it."""

    def __init__(self, image: str, volumes: Sequence[tuple[str | Path, str]] = ()):
        self.marker = uuid.uuid4().hex
        self.name = f"bloompeer-test-{self.marker[:12]}"
        self.volumes = [f"--volume={host}:{inside}" for host, inside in volumes]
        self.processes: list[PeerProcess] = []
        subprocess.run(["buildah", "from", "--pull-never", "--name", self.name, image], capture_output=True,
                       check=True)

    def command(self, env: dict[str, str] | None = None) -> list[str]:
        """`buildah run` for this container, up to the `--` after which the command goes."""
        env = {MARKER_ENV: self.marker, **(env or {})}
        return [*BUILDAH_RUN, *self.volumes, *[f"--env={name}={value}" for name, value in env.items()], self.name,
                "--"]

    def run(self, args: Sequence[str], timeout_s: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run([*self.command(), *args], capture_output=True, text=True, timeout=timeout_s)

    def start(self, name: str, args: Sequence[str], log_dir: Path) -> PeerProcess:
        """A long-running command (a peer), its stdout lines read as they come, stderr in a log file."""
        process = PeerProcess(name, args, log_dir, program=self.command())
        self.processes.append(process)
        return process

    def pids(self) -> list[int]:
        """Live processes started in this container (the chroot side of `buildah run` and below)."""
        return processes_with_env(MARKER_ENV, self.marker)

    def pid_of(self, *argv_words: str) -> int:
        """The one live process in the container whose command line has all of `argv_words`."""
        found = [pid for pid in self.pids()
                 if set(argv_words) <= set(argv := _argv(pid)) and "buildah" not in argv[0]]
        assert len(found) == 1, f"{len(found)} processes in {self.name} run {argv_words}: {found}"
        return found[0]

    def mount(self) -> Path:
        """Where the container's files are on the host (unmounted again by close())."""
        return Path(subprocess.run(["buildah", "mount", self.name], capture_output=True, text=True,
                                   check=True).stdout.strip())

    def close(self) -> None:
        for process in self.processes:
            process.stop(timeout_s=10)
        deadline = time.monotonic() + 30
        while (left := self.pids()) and time.monotonic() < deadline:
            for pid in left:  # `buildah run` killed hard leaves its processes behind
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        subprocess.run(["buildah", "rm", self.name], capture_output=True)
        assert not left, f"processes of {self.name} would not die: {left}"

    def __enter__(self) -> Container:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _argv(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []
