"""The image build as a background process of the test session.

A cold build (debootstrap, then torch and the dependencies from the package index) takes minutes
of mostly network and disk: it starts as soon as the session has collected tests/image, runs at the
lowest priority beside the other tests, and the image tests (run last) wait for it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["ImageBuild"]

REPO = Path(__file__).resolve().parents[2]
BUILD_SCRIPT = REPO / "scripts" / "build_image.py"


def _containers() -> set[str]:
    listed = subprocess.run(["buildah", "containers", "--quiet", "--notruncate"], capture_output=True, text=True)
    return set(listed.stdout.split())


class ImageBuild:
    """scripts/build_image.py running in its own process group; its output in a log file."""

    def __init__(self, tag: str):
        self.tag = tag
        self.problem: str | None = None
        self.process: subprocess.Popen | None = None
        self.log_dir = Path(tempfile.mkdtemp(prefix="bloompeer-image-build-"))
        self.log_path = self.log_dir / "build.log"
        self._containers_before: set[str] = set()
        self._started = 0.0
        self.report = ""  # the script's timing lines, kept when the log goes

    def start(self) -> None:
        if os.geteuid() != 0:
            self.problem = "the image test must run as root (buildah's chroot isolation and debootstrap need it)"
            return
        missing = [tool for tool in ("buildah", "debootstrap") if shutil.which(tool) is None]
        if missing:
            self.problem = (f"{' and '.join(missing)} not installed: run the README's test command, which "
                            f"installs them (apt-get install {' '.join(missing)})")
            return
        self._containers_before = _containers()
        self._started = time.monotonic()
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                ["nice", "-n", "19", "ionice", "-c", "2", "-n", "7", sys.executable, str(BUILD_SCRIPT),
                 "--tag", self.tag, "--pip-python", sys.executable],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)

    def wait(self, timeout_s: float) -> str:
        """The built image's name; raises RuntimeError saying why there is none."""
        if self.problem is not None:
            raise RuntimeError(self.problem)
        if self.process is None:
            raise RuntimeError("the image build was never started (tests/image/conftest.py starts it after collection)")
        try:
            code = self.process.wait(max(0.0, self._started + timeout_s - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.stop()
            raise RuntimeError(f"the image build ran past {timeout_s:.0f} s\n{self.log_tail()}") from None
        if code != 0:
            raise RuntimeError(f"the image build failed (exit code {code})\n{self.log_tail()}")
        return self.tag

    def log_tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace").splitlines() if self.log_path.exists() else []
        return f"last lines of {self.log_path}:\n" + "\n".join(f"  build| {line}" for line in text[-lines:])

    def summary(self) -> str:
        """The script's timing lines, for the session's report."""
        text = self.log_path.read_text(errors="replace").splitlines() if self.log_path.exists() else []
        return "\n".join(line for line in text if line.startswith(("base:", "built in", "image:")))

    def stop(self) -> None:
        """End a build still running (SIGTERM lets buildah and the script clean up); after a build
        that did not succeed, remove the working containers it left (buildah's --force-rm covers a
        failed step, not a killed build). The log directory goes when the build succeeded."""
        if self.process is None:
            return
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.report = self.summary() if self.process.returncode == 0 else self.log_tail()
        if self.process.returncode == 0:
            shutil.rmtree(self.log_dir, ignore_errors=True)
        else:
            for container in _containers() - self._containers_before:
                subprocess.run(["buildah", "rm", container], capture_output=True)
