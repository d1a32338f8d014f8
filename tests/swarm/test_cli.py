"""The `bloompeer` command as a user runs it: real processes, output on stdout, clean exits."""

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import AutoTokenizer, BloomForCausalLM

from bloompeer.peer.cli.default_model import DEMO_MODEL_DIR
from bloompeer.peer.cli.local_swarm import BLOOMPEER_COMMAND, PeerProcess

from .conftest import MARKER_ENV, processes_with_env

CLI = [sys.executable, "-m", "bloompeer"]
# a stopping server drains, says goodbye on the DHT and exits, each step bounded by the server itself;
# past this it is SIGKILLed (exit code -9). A guard, generous for a loaded machine.
STOP_GUARD_S = 60.0


def _run(args, env=None, timeout=180):
    env = {k: v for k, v in {**os.environ, **(env or {})}.items() if k != "BLOOMPEER_INITIAL_PEERS"}
    return subprocess.run([*CLI, *args], capture_output=True, text=True, env=env, timeout=timeout)


def test_generate_prints_the_same_continuation_as_hf(swarm, tiny_checkpoint, reference_model):
    prompt = "A swarm of peers"
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.inference_mode():
        expected = reference_model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    result = _run(["generate", prompt, "--model", str(tiny_checkpoint), "--max-new-tokens", "8",
                   "--initial-peers", *swarm.initial_peers])
    assert result.returncode == 0, result.stderr
    assert result.stdout.rstrip("\n") == prompt + tokenizer.decode(expected[0, ids.shape[1]:], skip_special_tokens=True)


def test_speculative_generate_prints_the_same_text(swarm, tiny_checkpoint):
    args = ["generate", "A swarm of peers", "--model", str(tiny_checkpoint), "--max-new-tokens", "12",
            "--initial-peers", *swarm.initial_peers]
    speculations = ([], ["--prompt-lookup", "3"], ["--draft-model", str(tiny_checkpoint)])  # the target as draft
    with ThreadPoolExecutor(len(speculations)) as pool:  # three commands at once: each its own process
        plain, *speculative = pool.map(lambda speculation: _run([*args, *speculation]), speculations)
    assert plain.returncode == 0, plain.stderr
    for result in speculative:
        assert result.returncode == 0, result.stderr
        assert result.stdout == plain.stdout


def test_initial_peers_from_the_environment(swarm, tiny_checkpoint):
    result = _run(["generate", "env", "--model", str(tiny_checkpoint), "--max-new-tokens", "2"],
                  env={"BLOOMPEER_INITIAL_PEERS": " ".join(swarm.initial_peers)})
    assert result.returncode == 0 and result.stdout.startswith("env"), result.stderr


def test_generate_waits_for_missing_blocks_then_fails_clearly(swarm, tiny_checkpoint, tmp_path):
    unserved = tmp_path / "unserved-model"  # same weights under a name no server announces
    shutil.copytree(tiny_checkpoint, unserved)
    result = _run(["generate", "x", "--model", str(unserved), "--timeout", "2", "--initial-peers",
                   *swarm.initial_peers])
    assert result.returncode == 1
    assert "waiting" in result.stderr.lower() and "block(s) 0:4 of unserved-model" in result.stderr


def test_generate_without_peers_runs_a_local_swarm_and_leaves_nothing(tmp_path):
    """The README's main command: the bundled demo model, through a local swarm, then nothing left.
    The swarm takes the shortcuts of a swarm for one command (local_swarm.ONE_COMMAND_SWARM): its
    servers only estimate their throughput, and keep no such estimate for later runs."""
    marker = uuid.uuid4().hex
    cache, logs = tmp_path / "cache", tmp_path / "logs"
    result = _run(["generate", "Once upon a time", "--max-new-tokens", "24", "--swarm-logs", str(logs)],
                  env={"BLOOMPEER_CACHE": str(cache), MARKER_ENV: marker})
    assert result.returncode == 0, result.stderr
    server_logs = [path.read_text() for path in sorted(logs.glob("server*.log"))]
    assert len(server_logs) == 2 and all("(--quick-throughput: not kept)" in log for log in server_logs)
    assert all("Started in" in log and "reachability check" not in log for log in server_logs)
    assert not (cache / "throughput.json").exists()
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL_DIR)
    reference = BloomForCausalLM.from_pretrained(DEMO_MODEL_DIR, dtype=torch.float32).eval()
    ids = tokenizer("Once upon a time", return_tensors="pt").input_ids
    with torch.inference_mode():
        expected = reference.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0)
    continuation = tokenizer.decode(expected[0, ids.shape[1]:], skip_special_tokens=True)
    assert result.stdout.rstrip("\n") == "Once upon a time" + continuation
    assert len(re.findall(r"\b[a-z]{2,}\b", continuation)) >= 10  # words, not byte soup
    routes = [line for line in result.stderr.splitlines() if "Route for blocks 0:6" in line]
    assert len(routes) == 1 and routes[0].count("[") == 2  # one line: which peer served which blocks
    assert processes_with_env(MARKER_ENV, marker) == []


def test_ctrl_c_during_generation_stops_everything(tmp_path, tiny_checkpoint):
    """Ctrl-C while a local swarm generates: exit code 130, nothing left running. (The tiny random
    model, unlike the demo model, never ends its text early with an end-of-sequence token.)"""
    marker = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if k != "BLOOMPEER_INITIAL_PEERS"}
    process = subprocess.Popen([*CLI, "generate", "Once upon a time", "--model", str(tiny_checkpoint),
                                "--max-new-tokens", "4000"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**env, "BLOOMPEER_CACHE": str(tmp_path), MARKER_ENV: marker})
    try:
        assert process.stdout.read(len("Once upon a time") + 10)  # generation is under way
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 130
    finally:
        process.kill()
        process.communicate()
    assert processes_with_env(MARKER_ENV, marker) == []


def test_bad_arguments_are_explained():
    result = _run(["serve", "--model", "x", "--blocks", "4:2"])
    assert result.returncode == 2 and "start < end" in result.stderr
    result = _run(["generate", "x", "--greedy", "--temperature", "0.5", "--initial-peers", UNREACHABLE_PEER])
    assert result.returncode == 1 and "--greedy cannot be combined" in result.stderr


def test_serve_refuses_blocks_beyond_the_model(swarm, tiny_checkpoint):
    result = _run(["serve", "--model", str(tiny_checkpoint), "--blocks", "2:9", "--initial-peers",
                   *swarm.initial_peers])
    assert result.returncode == 2 and "--blocks 2:9 is not within the model's 4 blocks (0:4)" in result.stderr


@pytest.mark.parametrize("args, says", [
    (["serve", "--model", "/missing", "--blocks", "0:2"], "/missing is not a directory"),
    (["serve", "--model", "{empty}", "--blocks", "0:2"], "has no config.json"),
    (["generate", "x", "--model", "./nowhere"], "./nowhere is not a directory"),
    (["generate", "x", "--verify-fraction", "1.5"], "--verify-fraction: 1.5 is not between 0 and 1"),
    (["status", "--model", "/missing"], "/missing is not a directory"),
    (["status"], "there is no swarm to ask: pass --initial-peers"),
    (["status", "--initial-peers", "/ip4/1.2.3.4/tcp/5"], "--initial-peers: /ip4/1.2.3.4/tcp/5 is not a peer's whole"),
    (["dht", "--host-maddrs", "0.0.0.0:31337"], "--host-maddrs: 0.0.0.0:31337 is not a multiaddr"),
    (["api", "--model", "/missing"], "/missing is not a directory"),
    (["serve", "--blocks", "0:99"], "--blocks 0:99 is not within the model's 6 blocks (0:6)"),
    (["serve", "--num-blocks", "7"], "--num-blocks 7 is more than the model's 6 blocks"),
    (["serve", "--blocks", "0:2", "--max-length", "0"], "--max-length: 0 is not at least 1"),
    (["serve", "--blocks", "0:2", "--device", "gpu"], "--device: gpu is not a device bloompeer computes on"),
    (["generate", "x", "--top-p", "0"], "--top-p: 0 is not more than 0 and at most 1"),
    (["api", "--port", "70000"], "--port: 70000 is not a port number"),
], ids=["serve-missing-model", "serve-not-a-checkpoint", "generate-missing-model", "verify-fraction", "status",
        "status-without-peers", "peer-without-id", "listen-address", "api", "blocks-beyond-model", "num-blocks-beyond-model", "max-length", "device", "top-p", "port"])
def test_arguments_are_checked_before_anything_starts(args, says, tmp_path):
    """A bad argument is refused in one line, before torch, hivemind or any process is started."""
    marker = uuid.uuid4().hex
    args = [arg.replace("{empty}", str(tmp_path)) for arg in args]
    result = _run(["-v", *args], env={MARKER_ENV: marker}, timeout=60)
    assert result.returncode == 2, result.stderr
    assert [line for line in result.stderr.splitlines() if "error:" in line] == [
        line for line in result.stderr.splitlines() if says in line], result.stderr
    assert "Traceback" not in result.stderr
    assert processes_with_env(MARKER_ENV, marker) == []


def test_initial_peers_from_the_environment_are_checked_as_the_flag_is():
    env = {**os.environ, "BLOOMPEER_INITIAL_PEERS": "/ip4/1.2.3.4/tcp/5"}
    result = subprocess.run([*CLI, "status"], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 2 and "$BLOOMPEER_INITIAL_PEERS: /ip4/1.2.3.4/tcp/5 is not a peer's whole address" \
        in result.stderr, result.stderr


def test_the_command_line_loads_no_heavy_module_before_it_must():
    """--help and argument checks import neither torch nor hivemind (they take seconds to load). The
    hivemind package itself may be in sys.modules, its init not run (p2p/hivemind_package.py): any
    use of hivemind imports hivemind.utils."""
    script = ("import sys\nfrom bloompeer.peer.cli.main import build_parser\nbuild_parser()\n"
              "print(sorted(m for m in ('torch', 'hivemind.utils', 'transformers') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "[]", result.stderr


@pytest.mark.parametrize("whole_group", [False, True], ids=["process", "process-group"])
def test_server_stops_on_sigterm_and_leaves_nothing_running(swarm, whole_group):
    """SIGTERM to the server (docker stop), or to its whole process group with its daemon (systemd)."""
    marker = uuid.uuid4().hex
    # a new interpreter, not a fork (tests/conftest.py): its marker then shows in /proc/PID/environ
    server = swarm.add_server(0, 1, name=f"sigterm-{whole_group}", env={MARKER_ENV: marker},
                              program=BLOOMPEER_COMMAND)
    assert len(processes_with_env(MARKER_ENV, marker)) >= 2  # the server and its p2pd
    if whole_group:
        os.killpg(server.pid, signal.SIGTERM)
    else:
        server.signal(signal.SIGTERM)
    assert server.wait_exit(30) == 0, server.log_tail()
    assert processes_with_env(MARKER_ENV, marker) == []
    assert "Traceback" not in server.log_path.read_text()


def test_a_stable_identity_keeps_the_peer_id_across_restarts(swarm, tmp_path):
    """--identity-path on the bootstrap (an Ed25519 key) and on a server (RSA: it also signs records)."""
    def dht_peer_id(run: int) -> str:
        bootstrap = PeerProcess(f"identity-dht-{run}", ["dht", "--host-maddrs", "/ip4/127.0.0.1/tcp/0",
                                                        "--identity-path", str(tmp_path / "dht.key")], tmp_path)
        try:
            return bootstrap.wait_for_line("/", time.monotonic() + 60).rsplit("/p2p/", 1)[1]
        finally:
            bootstrap.stop()

    def server_peer_id(run: int) -> str:
        server = swarm.add_server(0, 1, ["--identity-path", str(tmp_path / "server.key")], name=f"identity-{run}")
        assert server.stop(timeout_s=STOP_GUARD_S) == 0
        return server.peer_id_str

    with ThreadPoolExecutor(2) as pool:  # a bootstrap peer and a server at a time
        def both(run: int) -> list[str]:
            return [future.result() for future in (pool.submit(dht_peer_id, run), pool.submit(server_peer_id, run))]

        assert both(1) == both(2)


def test_announce_maddrs_replace_the_listening_ones(tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    bootstrap = PeerProcess("announce", ["dht", "--host-maddrs", f"/ip4/127.0.0.1/tcp/{port}",
                                         "--announce-maddrs", f"/ip4/203.0.113.9/tcp/{port}"], tmp_path)
    try:
        assert bootstrap.wait_for_line("/", time.monotonic() + 60).startswith(f"/ip4/203.0.113.9/tcp/{port}/p2p/")
    finally:
        bootstrap.stop()


UNREACHABLE_PEER = "/ip4/127.0.0.1/tcp/1/p2p/QmXZS9Q9rVs4aJ1KxsZmn7RgZRfcPT2Qm5Kc8aw7xT3d6E"


def test_commands_report_a_network_failure_in_one_line(tmp_path):
    """What a command raises becomes one "ERROR" line on stderr and exit code 1, no traceback (cli.main
    does it for every command: a peer command and a client command show it)."""
    commands = {"dht": ["dht", "--host-maddrs", "/ip4/203.0.113.1/tcp/5"],  # not an address of this machine
                "status": ["status", "--initial-peers", UNREACHABLE_PEER]}
    env = {k: v for k, v in os.environ.items() if k != "BLOOMPEER_INITIAL_PEERS"}
    running = {name: subprocess.Popen([*CLI, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      env={**env, "BLOOMPEER_CACHE": str(tmp_path)})
               for name, args in commands.items()}
    try:
        for name, process in running.items():
            _, stderr = process.communicate(timeout=120)
            assert process.returncode == 1, (name, stderr)
            errors = [line for line in stderr.splitlines() if " ERROR " in line]
            assert len(errors) == 1 and "could not start the libp2p daemon" in errors[0], (name, stderr)
            assert "Traceback" not in stderr, (name, stderr)
    finally:
        for process in running.values():
            process.kill()
            process.communicate()
