"""`bloompeer status` as a user runs it, against a live swarm: the table, --json, and a server gone."""

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

CLI = [sys.executable, "-m", "bloompeer"]
# A DHT lookup may miss a record for a while: a server's first store goes where its young routing
# table points (it stores again soon after going online, then every announce period), and a stop's
# goodbye reaches the peers it reaches. Each status is asked again until it shows what is expected,
# for up to this long: a guard; what is asserted is what status prints once the records are found.
LOOKUP_GUARD_S = 120.0
STOP_GUARD_S = 60.0  # the server drains, says goodbye and exits, each step bounded by the server itself


def _status(model, swarm, *extra) -> str:
    result = subprocess.run([*CLI, "status", "--model", str(model), "--initial-peers", *swarm.initial_peers, *extra],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout


def _json_and_table(model, swarm) -> tuple[dict, str]:
    """`status --json` and `status`, run at the same time (each is a new process that joins the DHT)."""
    with ThreadPoolExecutor(2) as pool:
        as_json, table = pool.map(lambda extra: _status(model, swarm, *extra), [("--json",), ()])
    return json.loads(as_json), table


def _json_and_table_when(model, swarm, found) -> tuple[dict, str]:
    """_json_and_table, asked again until found(data, table) (both lookups found what it needs), or
    for LOOKUP_GUARD_S (then the last answers, for the assertions to show)."""
    deadline = time.monotonic() + LOOKUP_GUARD_S
    while not found(*(answers := _json_and_table(model, swarm))) and time.monotonic() < deadline:
        pass
    return answers


def _states(data: dict) -> dict[int, list[tuple[str, str]]]:
    """Block index -> sorted [(peer id, state)], from `status --json`."""
    return {block["index"]: sorted((record["peer_id"], record["state"]) for record in block["servers"])
            for block in data["blocks"]}


def _server_rows(table: str) -> dict[str, list[str]]:
    """Short peer id -> the cells of its row in the table's server section."""
    return {line.split()[0]: line.split()[1:] for line in table.splitlines() if line.startswith("  …")}


def test_status_shows_who_serves_what_and_a_server_gone(swarm, fresh_model, start_servers):
    first, second = start_servers([(0, 3), (2, 4)])
    a, b = first.peer_id_str, second.peer_id_str

    def both_found(data, table) -> bool:
        rows = _server_rows(table)
        return (len(_states(data).get(2, [])) == 2 and not data["missing"]
                and "…" + a[-8:] in rows and "…" + b[-8:] in rows and "MISSING" not in table)

    data, table = _json_and_table_when(fresh_model, swarm, both_found)
    assert (data["model"], data["num_blocks"], data["missing"]) == (fresh_model.name, 4, [])
    assert _states(data) == {0: [(a, "online")], 1: [(a, "online")], 2: sorted([(a, "online"), (b, "online")]),
                             3: [(b, "online")]}
    assert table.splitlines()[0] == f"{fresh_model.name} (bloom family): 4 blocks" and "MISSING" not in table
    rows = _server_rows(table)
    assert rows["…" + a[-8:]][:2] == ["0:3", "online"] and rows["…" + b[-8:]][:2] == ["2:4", "online"]
    assert rows["…" + a[-8:]][2] == "float32"  # how it stores its weights
    assert rows["…" + a[-8:]][-1] == "direct" and float(rows["…" + a[-8:]][3]) > 0  # measured throughput

    assert second.stop(timeout_s=STOP_GUARD_S) == 0  # a clean stop announces the server offline on its way out

    def offline_found(data, table) -> bool:
        return ((b, "offline") in _states(data).get(3, [])
                and _server_rows(table).get("…" + b[-8:], [None, None])[1] == "offline")

    data, table = _json_and_table_when(fresh_model, swarm, offline_found)
    assert data["missing"] == [3]
    assert _states(data)[3] == [(b, "offline")] and _states(data)[2] == sorted([(a, "online"), (b, "offline")])
    assert f"  block    3  MISSING (…{b[-8:]} offline)" in table.splitlines()
    assert _server_rows(table)["…" + b[-8:]][:2] == ["2:4", "offline"]
