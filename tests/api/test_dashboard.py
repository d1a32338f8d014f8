"""The dashboard in a real headless browser (Debian's chromium): after its script ran, the page
shows every server and its block range; a screenshot is kept as a test artifact. Its JSON is the
data `bloompeer status --json` prints."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

CHROMIUM = "chromium"
# Chromium must not reach anything but the API on 127.0.0.1: no background services, no DNS, and
# every other address through a proxy that does not exist.
OFFLINE_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync", "--disable-default-apps",
    "--disable-domain-reliability", "--disable-client-side-phishing-detection", "--no-pings",
    "--disable-features=OptimizationHints,MediaRouter,Translate,AutofillServerCommunication",
    "--proxy-server=127.0.0.1:9", "--proxy-bypass-list=127.0.0.1",
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
)


def _chromium(profile: Path, *args: str) -> str:
    binary = shutil.which(CHROMIUM)
    if binary is None:
        pytest.fail("chromium is not installed; the dashboard test needs it: apt-get install chromium")
    result = subprocess.run([binary, *OFFLINE_FLAGS, f"--user-data-dir={profile}", *args], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def _live_servers(swarm, model_path) -> list:
    return [server for server in swarm.servers
            if server.process.poll() is None and f"serving {Path(model_path).name} " in (server.online_line or "")]


def test_the_page_shows_every_server_and_block_range(api, swarm, tiny_checkpoint, tmp_path):
    servers = _live_servers(swarm, tiny_checkpoint)
    assert len(servers) >= 2
    expected = [f"…{server.peer_id_str[-8:]}" for server in servers] + \
        [f"{server.blocks[0]}:{server.blocks[1]}" for server in servers]
    deadline = time.monotonic() + 90
    while True:  # the page fetches its data after load; dump the DOM until the script has drawn it
        dom = _chromium(tmp_path / "profile", "--virtual-time-budget=3000", "--dump-dom", api.base_url + "/")
        drawn = 'data-loaded="true"' in dom and all(text in dom for text in expected)
        if drawn or time.monotonic() > deadline:
            break
    assert drawn, f"the page does not show all of {expected}:\n{dom[-3000:]}"
    for server in servers:
        assert f'data-peer-id="{server.peer_id_str}"' in dom
    for index in range(4):
        assert f'data-block="{index}"' in dom
    assert "all covered" in dom
    assert "<td>float32</td>" in dom  # the weights column

    screenshot = tmp_path / "dashboard.png"
    _chromium(tmp_path / "profile", "--virtual-time-budget=3000", "--window-size=1100,560",
              f"--screenshot={screenshot}", api.base_url + "/")
    assert screenshot.stat().st_size > 10_000
    print(f"dashboard screenshot: {screenshot}")


def test_its_data_is_what_status_json_prints(api, swarm, tiny_checkpoint):
    status = subprocess.run([sys.executable, "-m", "bloompeer", "status", "--json", "--model", str(tiny_checkpoint),
                             "--initial-peers", *swarm.initial_peers], capture_output=True, text=True, timeout=120)
    assert status.returncode == 0, status.stderr
    from_status = json.loads(status.stdout)
    code, content_type, body = api.get("/api/swarm")
    assert code == 200 and content_type == "application/json"
    from_api = json.loads(body)
    live = {server.peer_id_str for server in _live_servers(swarm, tiny_checkpoint)}

    def live_records(state):
        return [sorted((r for r in block["servers"] if r["peer_id"] in live), key=lambda r: r["peer_id"])
                for block in state["blocks"]]

    assert {key: from_api[key] for key in ("model", "num_blocks", "missing")} == \
        {key: from_status[key] for key in ("model", "num_blocks", "missing")}
    assert set(from_api) == set(from_status) | {"latency_s"}
    assert live_records(from_api) == live_records(from_status)
    assert all(from_api["latency_s"][peer] > 0 for peer in live)  # measured by the API's client
