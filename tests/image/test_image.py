"""The volunteer image as a user gets it: its defaults, its user, and generation inside it."""

import re

import pytest

from .buildah import Container, image_config
from .conftest import PROMPT

BUILD_MOUNT = "/run/bloompeer-build"  # scripts/build_image.py mounts the pip settings there for the build


@pytest.fixture
def container(image):
    with Container(image) as container:
        yield container


def test_the_image_keeps_nothing_of_the_builds_pip_settings(image, container):
    config = image_config(image)
    env = dict(entry.split("=", 1) for entry in config["config"]["Env"])
    assert not {"PIP_CONFIG_FILE", "PIP_INDEX_URL", "PIP_FIND_LINKS", "PIP_CERT"} & env.keys()
    history = " ".join(step.get("created_by", "") for step in config["history"])
    assert "PIP_CONFIG_FILE=" + BUILD_MOUNT in history  # the one build argument: where the file was
    assert "/opt/wheels" not in history and "pypi.org" not in history and "ca.crt" not in history
    root = container.mount()
    left = sorted(str(path.relative_to(root)) for path in (root / BUILD_MOUNT.lstrip("/")).rglob("*"))
    assert all(re.fullmatch(r"run/bloompeer-build/local-\d+", path) for path in left), left  # empty mount points
    assert all(not (root / BUILD_MOUNT.lstrip("/") / path).exists() for path in ("pip.conf", "ca.crt"))
    assert not [path for path in ("etc/pip.conf", "etc/xdg/pip/pip.conf", "root/.config/pip/pip.conf",
                                  "home/volunteer/.config/pip/pip.conf") if (root / path).exists()]


def test_the_default_command_is_help_as_a_user_who_is_not_root(image, container):
    config = image_config(image)["config"]
    assert config["User"] == "volunteer"
    result = container.run([*config["Entrypoint"], *config["Cmd"]])  # what `docker run bloompeer` runs
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: bloompeer")
    for command in ("serve", "dht", "generate", "status"):
        assert command in result.stdout
    ids = container.run(["sh", "-c", "id -u; id -un; touch /data/identity/probe && echo writable"])
    assert ids.stdout.split() == ["1000", "volunteer", "writable"], ids.stderr


def test_generate_runs_a_local_swarm_inside_the_container(container, demo_continuation):
    """The README's main command in the image: a bootstrap peer and two servers of the demo model,
    all in the container; the text is transformers' on the same weights, and nothing is left."""
    result = container.run(["bloompeer", "generate", PROMPT], timeout_s=600)
    assert result.returncode == 0, result.stderr
    assert result.stdout.rstrip("\n") == PROMPT + demo_continuation
    routes = [line for line in result.stderr.splitlines() if "Route for blocks 0:6" in line]
    assert len(routes) == 1 and routes[0].count("[") == 2, result.stderr  # through both servers
    assert container.pids() == []
