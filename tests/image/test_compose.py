"""docker/compose.yaml's services, each in a container of the image, with their own commands.

As far as buildah allows: there is no compose engine, so each service's entrypoint and command are
run with `buildah run`, its named volumes are host directories (filled from the image as Docker
fills a new volume), and, since chroot isolation shares the host's network, the peers listen on
127.0.0.1 with ports of their own choosing instead of 0.0.0.0 and the published ports.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import time
import urllib.parse
from pathlib import Path

import pytest
import torch
import yaml
from transformers import AutoTokenizer

from bloompeer import ClientConfig, DistributedBloomForCausalLM, NetworkConfig
from bloompeer.peer.cli.default_model import DEMO_MODEL_DIR

from .buildah import Container
from .conftest import PROMPT

COMPOSE_FILE = Path(__file__).resolve().parents[2] / "docker" / "compose.yaml"
VOLUNTEER_UID = 1000  # the image's user
LISTEN = re.compile(r"/ip4/0\.0\.0\.0/tcp/\d+")
API_LISTEN = re.compile(r"--host 0\.0\.0\.0 --port \d+")
API_PORT = 8000  # the api service's, which its health check asks


def service_argv(service: dict, image_entrypoint: list[str]) -> list[str]:
    """What compose would run: entrypoint then command, `$$` read as `$`; listening on loopback."""
    argv = [*service.get("entrypoint", image_entrypoint), *service["command"]]
    return [API_LISTEN.sub("--host 127.0.0.1 --port 0", LISTEN.sub("/ip4/127.0.0.1/tcp/0", arg.replace("$$", "$")))
            for arg in argv]


def health_check_argv(service: dict, port: int) -> list[str]:
    """The service's health check command (compose's `CMD` form), asking `port` instead of the published one."""
    kind, *argv = service["healthcheck"]["test"]
    assert kind == "CMD"
    return [arg.replace(f"127.0.0.1:{API_PORT}", f"127.0.0.1:{port}") for arg in argv]


@pytest.fixture
def services(image, tmp_path):
    """start(name) -> the service's process in a container of its own; every container removed after,
    and the services' logs printed (pytest shows them if the test failed)."""
    compose = yaml.safe_load(COMPOSE_FILE.read_text())
    volume_dirs = {name: tmp_path / "volumes" / name for name in compose["volumes"]}
    containers, started = [], {}

    def volume(name: str, inside: str) -> Path:
        host = volume_dirs[name]
        if not host.exists():  # like a new named volume: the image's files at that path, with their owners
            if not containers:
                containers.append(Container(image))  # the image's files, to copy from
            shutil.copytree(containers[0].mount() / inside.lstrip("/"), host, symlinks=True)
            for path in [host, *host.rglob("*")]:
                shutil.chown(path, VOLUNTEER_UID, VOLUNTEER_UID)
        return host

    def container_for(name: str) -> Container:
        service = compose["services"][name]
        mounts = [(volume(*entry.split(":", 1)), entry.split(":", 1)[1]) for entry in service["volumes"]]
        container = Container(image, mounts)
        containers.append(container)
        return container

    def start(name: str):
        container = container_for(name)
        started[name] = container.start(name, service_argv(compose["services"][name], ["bloompeer"]), tmp_path)
        return container, started[name]

    def run(name: str, timeout_s: float):
        container = container_for(name)
        return container.run(service_argv(compose["services"][name], ["bloompeer"]), timeout_s=timeout_s)

    yield start, run
    for container in reversed(containers):
        container.close()
    for name, process in started.items():
        print(f"--- {name}'s log ---\n{process.log_tail()}")


def test_compose_services_generate_and_the_server_drains_on_sigterm(services, tmp_path, demo_continuation):
    start, run = services
    deadline = time.monotonic() + 240
    _, bootstrap = start("bootstrap")
    bootstrap_maddr = bootstrap.wait_for_line("/ip4/127.0.0.1/", deadline)
    server_container, server = start("server")  # it waits for the maddrs file the bootstrap peer wrote
    server.wait_online(deadline)
    assert server.blocks == (0, 6)
    server_pid = server_container.pid_of("serve")
    assert _uid(server_pid) == VOLUNTEER_UID  # the peer itself runs as the image's user, not as root

    client = run("client", timeout_s=300)
    assert client.returncode == 0, client.stderr
    assert client.stdout.rstrip("\n") == PROMPT + demo_continuation

    api_container, api = start("api")
    api_port = urllib.parse.urlsplit(api.wait_for_line("api: ", deadline).split(" ", 1)[1]).port
    health_check = health_check_argv(yaml.safe_load(COMPOSE_FILE.read_text())["services"]["api"], api_port)
    assert _healthy_within(api_container, health_check, 60, want=True)

    # `docker stop` (with compose's `init: true`) is SIGTERM to the server: with a session still
    # open, it waits for it up to its drain timeout (5 s by default), then exits cleanly by itself
    config = ClientConfig(NetworkConfig(initial_peers=(bootstrap_maddr,), client_mode=True))
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    with DistributedBloomForCausalLM.from_pretrained(DEMO_MODEL_DIR, client_config=config) as model:
        with model.inference_session(max_length=16) as session, torch.inference_mode():
            model(tokenizer(PROMPT, return_tensors="pt").input_ids)
            assert [span.peer_id_str for span in session.route] == [server.peer_id_str]
            os.kill(server_pid, signal.SIGTERM)
            assert server.wait_exit(60) == 0
    log = server.log_path.read_text()
    assert "Drained: 1 session(s) still open after 5 s" in log, server.log_tail()
    assert "Traceback" not in log
    assert server_container.pids() == []
    # with its only server gone, the api turns unhealthy once its view of the swarm is refreshed (10 s)
    assert _healthy_within(api_container, health_check, 60, want=False)


def _healthy_within(container, health_check: list[str], timeout_s: float, want: bool) -> bool:
    """Run the health check in the container until it says `want` (True: healthy); False if it never does."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        checked = container.run(health_check, timeout_s=30)
        if (checked.returncode == 0) == want:
            assert want or "503" in checked.stderr, checked.stderr  # unhealthy: the endpoint said so
            return True
    return False


def _uid(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"^Uid:\s+(\d+)", status, re.MULTILINE).group(1))
