#!/usr/bin/env python3
"""Build the volunteer image (docker/Dockerfile) with buildah: no Docker engine, no registry.

    sudo python3 scripts/build_image.py [--tag localhost/bloompeer:latest]

How CI builds the image that tests/image runs. Steps:
  1. the base: a Debian bookworm made by debootstrap (--variant=minbase, with python3 and
     python3-venv), kept as a tarball in /var/cache/bloompeer-image/ under a hash of its recipe and
     imported into buildah's storage as localhost/bloompeer-base:<hash>, so that a warm run skips
     both the debootstrap and the import;
  2. `buildah build --isolation chroot --layers` of docker/Dockerfile on that base
     (`--build-arg BASE=...`), with this machine's pip settings (index, extra indexes, find-links,
     CA bundle) in a pip config file mounted read-only for the build together with every local
     directory it names (`--build-arg PIP_CONFIG_FILE=...`). Nothing of them is stored in the
     image: not the file, not the values (build arguments would be recorded in its history); the
     only trace is the empty mount point /run/bloompeer-build.

Needs root, buildah and debootstrap (the README's test command installs them); says what is
missing otherwise. Prints each step's time and, last, `image: <tag> <size>`.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import unquote, urlparse

REPO = Path(__file__).resolve().parent.parent
CACHE_DIR = Path("/var/cache/bloompeer-image")
BASE_RECIPE = {  # change anything here (or how the rootfs is made below) and the base is made anew
    "recipe": 1, "suite": "bookworm", "variant": "minbase", "include": ["python3", "python3-venv"],
    "dropped": ["var/cache/apt", "var/lib/apt/lists"],
    "env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
}
BUILD_MOUNT = "/run/bloompeer-build"  # where the pip config and what it names appear during the build
PIP_LIST_KEYS = ("extra-index-url", "find-links", "trusted-host")
PIP_KEYS = ("index-url", *PIP_LIST_KEYS, "cert", "proxy")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tag", default="localhost/bloompeer:latest", help="name of the built image")
    parser.add_argument("--cache-dir", type=Path, default=CACHE_DIR, help=f"where the base is kept ({CACHE_DIR})")
    parser.add_argument("--mirror", default="http://deb.debian.org/debian", help="Debian mirror for debootstrap")
    parser.add_argument("--pip-python", default=sys.executable,
                        help="python whose pip settings the build uses (this one)")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # so that the cleanups below run
    try:
        _check_prerequisites()
        started = time.monotonic()
        args.cache_dir.mkdir(parents=True, exist_ok=True)
        with _exclusive(args.cache_dir / "lock"):
            base = _base_image(args.cache_dir, args.mirror)
            _log(f"base: {base} ready after {time.monotonic() - started:.0f} s")
            building = time.monotonic()
            previous = _image_id(args.tag)
            _build(args.tag, base, _pip_settings(args.pip_python))
            _drop_if_untagged(previous)
        _log(f"built in {time.monotonic() - building:.0f} s ({time.monotonic() - started:.0f} s in all)")
        print(f"image: {args.tag} {_image_size(args.tag)}", flush=True)
        return 0
    except BuildFailed as exc:
        print(f"build_image: {exc}", file=sys.stderr, flush=True)
        return 1


class BuildFailed(RuntimeError):
    """A step failed; the message says which and what to do."""


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


def _log(message: str) -> None:
    print(message, flush=True)


def _check_prerequisites() -> None:
    if os.geteuid() != 0:
        raise BuildFailed("must run as root (buildah's chroot isolation and debootstrap need it): use sudo")
    missing = [tool for tool in ("buildah", "debootstrap", "tar") if shutil.which(tool) is None]
    if missing:
        raise BuildFailed(f"{', '.join(missing)} not found: apt-get install -y {' '.join(missing)}")


@contextlib.contextmanager
def _exclusive(lock_path: Path):
    """One build at a time on this machine: they share the cache and buildah's storage."""
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _run(command: list[str], what: str, **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(command, text=True, **kwargs)
    if result.returncode != 0:
        raise BuildFailed(f"{what} failed (exit code {result.returncode}): {' '.join(command)}")
    return result


def _image_exists(name: str) -> bool:
    return subprocess.run(["buildah", "inspect", "--type", "image", name], capture_output=True).returncode == 0


def _image_id(name: str) -> str | None:
    inspected = subprocess.run(["buildah", "inspect", "--type", "image", "--format", "{{.FromImageID}}", name],
                               capture_output=True, text=True)
    if inspected.returncode != 0:
        return None
    return inspected.stdout.strip() or None


def _drop_if_untagged(image_id: str | None) -> None:
    """The tag's previous image, if the build moved the tag away from it: removing it removes the layers
    only it used (those of the code that changed) and keeps the ones the new image shares with it."""
    if image_id is None:
        return
    listed = subprocess.run(["buildah", "images", "--json", "--no-trunc"], capture_output=True, text=True)
    for image in json.loads(listed.stdout or "[]"):
        if image["id"].removeprefix("sha256:") == image_id.removeprefix("sha256:") and not image.get("names"):
            subprocess.run(["buildah", "rmi", image_id], capture_output=True)


def _image_size(name: str) -> str:
    """The image's size as buildah reports it (its uncompressed layers, e.g. "1.9 GB")."""
    images = json.loads(_run(["buildah", "images", "--json", name], "buildah images", capture_output=True).stdout)
    return images[0]["size"]


def _base_image(cache_dir: Path, mirror: str) -> str:
    """localhost/bloompeer-base:<recipe hash>, made by debootstrap only when no cached copy exists."""
    key = hashlib.sha256(json.dumps(BASE_RECIPE, sort_keys=True).encode()).hexdigest()[:16]
    name = f"localhost/bloompeer-base:{key}"
    if _image_exists(name):
        _log(f"base: {name} is in buildah's storage")
        return name
    tarball = cache_dir / f"base-{key}.tar"
    if tarball.exists():
        _log(f"base: importing the cached {tarball}")
    else:
        started = time.monotonic()
        _debootstrap_tarball(tarball, mirror)
        _log(f"base: debootstrapped {tarball} in {time.monotonic() - started:.0f} s")
    container = _run(["buildah", "from", "scratch"], "buildah from scratch", capture_output=True).stdout.strip()
    try:
        _run(["buildah", "add", "--quiet", container, str(tarball), "/"], "importing the base")
        _run(["buildah", "config", *[f"--env={env}" for env in BASE_RECIPE["env"]], "--cmd", "/bin/bash",
              container], "buildah config")
        _run(["buildah", "commit", "--quiet", container, name], "committing the base", stdout=subprocess.DEVNULL)
    finally:
        subprocess.run(["buildah", "rm", container], capture_output=True)
    return name


def _debootstrap_tarball(tarball: Path, mirror: str) -> None:
    """debootstrap into a scratch directory beside the tarball, trim it, tar it (atomically)."""
    rootfs = Path(tempfile.mkdtemp(prefix="rootfs-", dir=tarball.parent))
    partial = tarball.with_suffix(".partial")
    try:
        _run(["debootstrap", f"--variant={BASE_RECIPE['variant']}", f"--include={','.join(BASE_RECIPE['include'])}",
              BASE_RECIPE["suite"], str(rootfs), mirror], "debootstrap", stdout=subprocess.DEVNULL)
        for dropped in BASE_RECIPE["dropped"]:  # package lists and downloaded .debs: 90 MB nobody needs
            for entry in (rootfs / dropped).glob("*"):
                shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
        _run(["tar", "-C", str(rootfs), "--exclude=./dev/*", "--exclude=./proc/*", "--exclude=./sys/*",
              "-cf", str(partial), "."], "tar of the base")
        partial.rename(tarball)
    finally:
        _unmount_under(rootfs)  # debootstrap mounts /proc and /sys there while it works
        shutil.rmtree(rootfs, ignore_errors=True)
        partial.unlink(missing_ok=True)


def _unmount_under(path: Path) -> None:
    prefix = str(path.resolve())
    with open("/proc/self/mounts") as mounts:
        points = [_unquote_octal(line.split()[1]) for line in mounts]
    for point in sorted((p for p in points if p == prefix or p.startswith(prefix + "/")), key=len, reverse=True):
        subprocess.run(["umount", "--lazy", point], capture_output=True)


def _unquote_octal(field: str) -> str:
    """/proc/mounts writes spaces and the like as \\040."""
    return field.encode().decode("unicode_escape")


def _pip_settings(python: str) -> dict[str, str]:
    """The values pip would use here (environment over the install section over global), from `pip config list`."""
    listed = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    found: dict[str, dict[str, str]] = {}
    for line in listed.splitlines():
        key, _, value = line.partition("=")
        section, _, option = key.rpartition(".")
        if option in PIP_KEYS and value:
            found.setdefault(option, {})[section] = ast.literal_eval(value)
    return {option: next(by[s] for s in (":env:", "install", "global") if s in by)
            for option, by in found.items() if by.keys() & {":env:", "install", "global"}}


def _build(tag: str, base: str, settings: dict[str, str]) -> None:
    with tempfile.TemporaryDirectory(prefix="bloompeer-build-") as staging:
        config, volumes = _build_mounts(settings, Path(staging))
        (Path(staging) / "pip.conf").write_text(config)
        _log("pip settings for the build:\n  " + config.strip().replace("\n", "\n  "))
        command = ["buildah", "build", "--isolation", "chroot", "--layers", "--force-rm", "--pull=never",
                   "-f", str(REPO / "docker" / "Dockerfile"),
                   "--ignorefile", str(REPO / "docker" / "Dockerfile.dockerignore"), "-t", tag,
                   "--build-arg", f"BASE={base}", "--build-arg", "TORCH_INDEX=",
                   "--build-arg", f"PIP_CONFIG_FILE={BUILD_MOUNT}/pip.conf",
                   *[f"--volume={host}:{inside}:ro" for host, inside in volumes], str(REPO)]
        _run(command, "buildah build")


def _build_mounts(settings: dict[str, str], staging: Path) -> tuple[str, list[tuple[str, str]]]:
    """pip.conf text with every local path moved under BUILD_MOUNT, and the (host, build) mounts for them."""
    volumes = [(str(staging), BUILD_MOUNT)]
    lines = ["[global]"]

    def mount(host_path: Path) -> str:
        inside = f"{BUILD_MOUNT}/local-{len(volumes)}"
        (staging / inside.rsplit("/", 1)[1]).mkdir()  # the mount point, inside the read-only staging mount
        volumes.append((str(host_path), inside))
        return inside

    def local(value: str, is_index: bool) -> str:
        parsed = urlparse(value)
        if parsed.scheme not in ("", "file"):
            return value
        path = Path(unquote(parsed.path))
        if not path.exists():
            return value  # pip skips it here too
        if is_index:  # a file:// index's pages link to files beside it (../../files/...): mount its parent
            return f"file://{mount(path.parent)}/{path.name}"
        return mount(path)

    for option in PIP_KEYS:
        if option == "cert" or option not in settings:
            continue
        values = settings[option].split() if option in PIP_LIST_KEYS else [settings[option]]
        if option in ("index-url", "extra-index-url", "find-links"):
            values = [local(value, is_index=option != "find-links") for value in values]
        lines.append(f"{option} = {' '.join(values)}")
    ca_bundle = settings.get("cert") or ssl.get_default_verify_paths().cafile
    if ca_bundle and Path(ca_bundle).is_file():  # the host's CA bundle (it may trust a proxy the image must not)
        shutil.copyfile(ca_bundle, staging / "ca.crt")
        lines.append(f"cert = {BUILD_MOUNT}/ca.crt")
    return "\n".join(lines) + "\n", volumes


if __name__ == "__main__":
    sys.exit(main())
