"""Where one decode step's time goes, through a loopback swarm of 2 servers, beside local transformers.

For each model (the bundled demo model; the bloom-560m shape with random weights): starts a
bootstrap peer and 2 servers on 127.0.0.1 with `--metrics-port 0`, generates greedily with push and
without it, and splits the mean decode step into:

  client before   from the token's logits to the step's frame written (sampling, embedding, packing,
                  the hand-off to the client's network thread);
  between hops    without push: from a server's answer in to the next server's step written;
  daemon trips    the libp2p daemons' round trips the step makes (push: client -> server 1 -> server 2
                  -> client, 1.5 round trips; no push: 2), each measured in this run by an echo of a
                  frame of the step's size between two daemons of their own;
  server phases   decode, queue, compute, resume, encode summed over the servers, from their
                  `bloompeer_server_step_phase_seconds` histograms (peer/server/step_clock.py says
                  what each covers), scraped before and after;
  not covered     the step's time in flight less the daemon trips and the server phases: the
                  daemons' hand-offs to and from our processes beyond the echo's, frames between
                  their bytes and our reads;
  client after    from the last answer's bytes in to the next token's logits (unpacking, the
                  hand-back to generate's thread, final norm and LM head).

Per-hop software cost = (step - servers' compute - daemon trips) / hops, the issue-42 figure. Beside it,
in each round, its floor on this machine: the same blocks through the leanest chain of 2 server
processes (benchmarks/lean_chain.py: blocking loopback sockets, a plain greedy loop), its steps
paired with the same loop run in one process.
Runners take turns in each round (the machine drifts 10-30 % within an hour); figures are means
over every step of every round, so that the parts add up to the step, with each round's step beside.

    python benchmarks/step_anatomy.py                       # demo model and bloom-560m shape
    python benchmarks/step_anatomy.py --models demo --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import os
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bloompeer  # noqa: F401,E402  (before torch, as in its CLI: bloompeer/_openmp.py)
import torch  # noqa: E402
from hivemind.p2p import P2P  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from transformers import AutoModelForCausalLM, LogitsProcessor, LogitsProcessorList  # noqa: E402

from benchmarks.lean_chain import paired_steps, summary  # noqa: E402
from bloompeer import AutoDistributedModelForCausalLM, ClientConfig, NetworkConfig  # noqa: E402
from bloompeer.p2p import Step, StepOutput, framing, streams  # noqa: E402
from bloompeer.peer.cli.default_model import write_random_checkpoint  # noqa: E402
from bloompeer.peer.cli.local_swarm import LocalSwarm, split_blocks  # noqa: E402
from bloompeer.peer.client.runtime import THREAD_NAME as CLIENT_THREAD  # noqa: E402
from bloompeer.peer.server.step_clock import PHASES  # noqa: E402

DEMO_MODEL = Path(__file__).resolve().parents[1] / "bloompeer" / "demo_model"
MODELS = {  # name -> write_random_checkpoint arguments (None: the bundled demo model as it is)
    "demo": None,
    "bloom-560m": dict(num_blocks=24, hidden_size=1024, num_heads=16, vocab_size=250880, max_shard_size="1GB"),
}
MODES = {"push": True, "no push": False}
MODES_FIRST = next(iter(MODES))
DAEMON_TRIPS = {"push": 1.5, "no push": 2.0}  # round trips per step through 2 servers
ECHO_PROTOCOL = "/bloompeer-bench/echo/1"


class _TokenClock(LogitsProcessor):
    """When each new token's logits are ready (generate calls it once per token); `after_prompt` runs
    once the prompt's logits are in, before the clock starts."""

    def __init__(self, after_prompt=lambda: None):
        self.times: list[float] = []
        self.after_prompt = after_prompt

    def __call__(self, input_ids, scores):
        if not self.times:
            self.after_prompt()
        self.times.append(time.perf_counter())
        return scores


@dataclass
class _WireClock:
    """When the client's step frames were written and its answers' bytes were in (perf_counter)."""

    sent: list[float] = field(default_factory=list)
    answered: list[float] = field(default_factory=list)

    def install(self) -> None:
        """Wrap the one stream boundary's frame functions (p2p/streams.py) in this process."""
        write, clock = streams.write_frame, self

        async def write_frame(writer, message):
            await write(writer, message)
            if message.get("type") == Step.TYPE:
                clock.sent.append(time.perf_counter())

        async def read_frame(reader, max_bytes=framing.DEFAULT_MAX_FRAME_BYTES):
            body = await framing.read_frame_body(reader, max_bytes)
            arrived = time.perf_counter()
            message = framing.unpack(body)
            if message.get("type") == StepOutput.TYPE:
                clock.answered.append(arrived)
            return message

        streams.write_frame, streams.read_frame = write_frame, read_frame


def _client_parts(tokens: list[float], wire: _WireClock) -> dict[str, list[float]]:
    """Per decode step (between consecutive tokens' logits): the client's parts, in seconds."""
    parts = {"step": [], "client before": [], "between hops": [], "in flight": [], "client after": []}
    for begin, end in zip(tokens, tokens[1:]):
        sent = [t for t in wire.sent if begin < t < end]
        answered = [t for t in wire.answered if begin < t < end]
        if not sent or not answered:
            continue
        parts["step"].append(end - begin)
        parts["client before"].append(sent[0] - begin)
        parts["between hops"].append(sum(s - a for s, a in zip(sent[1:], answered)))  # no push: reply -> next send
        parts["in flight"].append(answered[-1] - sent[0] - parts["between hops"][-1])
        parts["client after"].append(end - answered[-1])
    return parts


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _thread_cpu_s(pid: int) -> dict[int, float]:
    """{thread id: user + system CPU seconds} of a process's threads, from /proc."""
    times = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            with open(f"/proc/{pid}/task/{tid}/stat") as file:
                fields = file.read().rsplit(")", 1)[1].split()
            times[int(tid)] = (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS
    return times


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as file:
        return [int(child) for child in file.read().split()]


class _CpuMeter:
    """CPU seconds by role, read from /proc around a generation: unlike wall time, what our own code
    costs per step shows through the machine's other load (a busy machine delays a thread, it does
    not make it spend more CPU; its caches do, a little)."""

    def __init__(self, swarm: LocalSwarm):
        me = os.getpid()
        network = [(me, thread.native_id) for thread in threading.enumerate() if thread.name == CLIENT_THREAD]
        peers = {server.pid for server in swarm.servers} | {swarm.bootstrap.pid}
        self.roles: dict[str, list[tuple[int, int | None]]] = {  # role -> (pid, tid or None: every other thread)
            "client: generate's thread": [(me, me)], "client: network threads": network,
            "servers: event loops": [(server.pid, server.pid) for server in swarm.servers],
            "servers: compute threads": [(server.pid, None) for server in swarm.servers],
            "libp2p daemons": [(daemon, None) for peer in (me, *(server.pid for server in swarm.servers))
                               for daemon in _children(peer) if daemon not in peers],
        }

    def read(self) -> dict[str, float]:
        totals = {}
        for role, threads in self.roles.items():
            totals[role] = 0.0
            for pid, tid in threads:
                cpu = _thread_cpu_s(pid)
                taken = {t for role_threads in self.roles.values() for p, t in role_threads if p == pid and t}
                totals[role] += cpu.get(tid, 0.0) if tid else sum(v for t, v in cpu.items() if t not in taken)
        return totals


def _scrape_phases(url: str) -> dict[str, tuple[float, float]]:
    """{phase: (seconds, steps)} of one server."""
    with urllib.request.urlopen(url, timeout=30) as response:
        text = response.read().decode()
    totals = {phase: [0.0, 0.0] for phase in PHASES}
    for family in text_string_to_metric_families(text):
        if family.name == "bloompeer_server_step_phase_seconds":
            for sample in family.samples:
                index = {"_sum": 0, "_count": 1}.get(sample.name.removeprefix(family.name))
                if index is not None:
                    totals[sample.labels["phase"]][index] += sample.value
    return {phase: (seconds, steps) for phase, (seconds, steps) in totals.items()}


def _phases_after(urls: list[str], steps: list[float], timeout_s: float = 30.0) -> list[dict]:
    """Each server's phases once it has counted `steps[i]` steps (a server observes a step just after
    its answer is written, so the client may read the answer first)."""
    deadline = time.monotonic() + timeout_s
    while True:
        scraped = [_scrape_phases(url) for url in urls]
        if all(phases["compute"][1] >= count for phases, count in zip(scraped, steps)):
            return scraped
        if time.monotonic() > deadline:
            raise TimeoutError(f"the servers counted {[p['compute'][1] for p in scraped]} steps, expected {steps}")
        time.sleep(0.001)


async def _echo_round_trip_s(frame_bytes: int, trips: int) -> list[float]:
    """Round trips of a `frame_bytes` frame between two fresh daemons on 127.0.0.1, echoed by a
    handler that only reads and writes bytes: the floor under any request through the daemons."""
    server = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    client = None
    try:
        async def echo(info, reader, writer):
            with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
                while True:
                    body = await framing.read_frame_body(reader)
                    writer.write(len(body).to_bytes(framing.HEADER_BYTES, "big") + body)
                    await writer.drain()

        await server.add_binary_stream_handler(ECHO_PROTOCOL, echo)
        client = await P2P.create(initial_peers=await server.get_visible_maddrs())
        _, reader, writer = await client.call_binary_stream_handler(server.peer_id, ECHO_PROTOCOL)
        frame = (frame_bytes - framing.HEADER_BYTES).to_bytes(framing.HEADER_BYTES, "big") + bytes(
            frame_bytes - framing.HEADER_BYTES)
        times = []
        for _ in range(trips):
            start = time.perf_counter()
            writer.write(frame)
            await writer.drain()
            await framing.read_frame_body(reader)
            times.append(time.perf_counter() - start)
        writer.close()
        return times[trips // 10:]  # the first ones warm the connection up
    finally:
        for peer in (client, server):
            if peer is not None:
                await peer.shutdown()


def _generate(model, prompt: torch.Tensor, new_tokens: int, after_prompt=lambda: None) -> list[float]:
    clock = _TokenClock(after_prompt)
    model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                   logits_processor=LogitsProcessorList([clock]), pad_token_id=0)
    return clock.times


@torch.inference_mode()
def bench(name: str, args: argparse.Namespace) -> dict:
    spec = MODELS[name]
    with tempfile.TemporaryDirectory(prefix=f"bloompeer-anatomy-{name}-") as tmp, contextlib.ExitStack() as stack:
        if spec is None:
            path, num_blocks, vocab = DEMO_MODEL, 6, 4096
        else:
            print(f"[{name}] writing a random checkpoint...", file=sys.stderr, flush=True)
            path, num_blocks, vocab = write_random_checkpoint(Path(tmp) / name, **spec), spec["num_blocks"], spec[
                "vocab_size"]
        prompt = torch.randint(4, vocab, (1, args.prompt_tokens), generator=torch.Generator().manual_seed(0))
        local = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        print(f"[{name}] starting a swarm of 2 servers...", file=sys.stderr, flush=True)
        swarm = stack.enter_context(LocalSwarm(path, split_blocks(num_blocks, 2), ["--metrics-port", "0"]))
        urls = [next(line for line in server.stdout if line.startswith("metrics: ")).split(" ", 1)[1]
                for server in swarm.servers]
        wire = _WireClock()
        wire.install()
        clients = {}
        for mode, push in MODES.items():
            config = ClientConfig(NetworkConfig(initial_peers=tuple(swarm.initial_peers), client_mode=True), push=push)
            clients[mode] = stack.enter_context(AutoDistributedModelForCausalLM.from_pretrained(path, client_config=config))
        hidden = torch.zeros(1, 1, local.config.hidden_size)
        frame_bytes = len(framing.pack(Step(0, hidden).to_wire())) + framing.HEADER_BYTES
        for model in (local, *clients.values()):
            _generate(model, prompt, 4)  # warm-up: caches, route, connections
        meter = _CpuMeter(swarm)
        results = {"local": [], "echo": [], "floor": {}, **{mode: {"parts": {}, "phases": {}, "rounds": [], "cpu": {}}
                                                         for mode in MODES}}
        for round_index in range(args.rounds):
            print(f"[{name}] round {round_index + 1} of {args.rounds}...", file=sys.stderr, flush=True)
            times = _generate(local, prompt, args.new_tokens)
            results["local"] += [b - a for a, b in zip(times, times[1:])]
            results["echo"] += asyncio.run(_echo_round_trip_s(frame_bytes, args.echo_trips))
            for part, values in paired_steps(str(path), split_blocks(num_blocks, 2), prompt, args.new_tokens).items():
                results["floor"].setdefault(part, []).extend(values)
            for mode, model in clients.items():
                wire.sent.clear(), wire.answered.clear()
                counts = [phases["compute"][1] for phases in _phases_after(urls, [0.0] * len(urls))]
                before, cpu_before = [], {}  # once the prompt's step is counted: decode steps only

                def after_prompt():
                    before.extend(_phases_after(urls, [count + 1 for count in counts]))
                    cpu_before.update(meter.read())

                parts = _client_parts(_generate(model, prompt, args.new_tokens, after_prompt), wire)
                cpu_after = meter.read()
                after = _phases_after(urls, [count + args.new_tokens for count in counts])
                for role, seconds in cpu_after.items():
                    results[mode]["cpu"][role] = results[mode]["cpu"].get(role, 0.0) + (
                        seconds - cpu_before[role]) / (args.new_tokens - 1)
                for part, values in parts.items():
                    results[mode]["parts"].setdefault(part, []).extend(values)
                for phase in PHASES:
                    seconds, steps = results[mode]["phases"].get(phase, (0.0, 0.0))
                    results[mode]["phases"][phase] = (
                        seconds + sum(a[phase][0] - b[phase][0] for a, b in zip(after, before)),
                        steps + sum(a[phase][1] - b[phase][1] for a, b in zip(after, before)) / len(urls))
                results[mode]["rounds"].append(statistics.mean(parts["step"]))
        results["frame_bytes"] = frame_bytes
        return results


def report(name: str, results: dict) -> None:
    ms = 1000.0
    local = statistics.mean(results["local"]) * ms
    echo = statistics.median(results["echo"]) * ms
    print(f"\n{name}: local transformers step {local:.3f} ms (mean), daemon echo round trip of a "
          f"{results['frame_bytes']}-byte frame {echo:.3f} ms (median)")
    print(f"  {'part (ms per step, mean)':<28}" + "".join(f"{mode:>10}" for mode in MODES))
    rows: dict[str, list[float]] = {}
    for mode in MODES:
        parts, phases = results[mode]["parts"], results[mode]["phases"]
        server = {phase: seconds / steps * ms for phase, (seconds, steps) in phases.items()}  # over both servers
        trips = DAEMON_TRIPS[mode] * echo
        mean = {part: statistics.mean(values) * ms for part, values in parts.items()}
        covered = trips + sum(server.values())
        column = {"client before": mean["client before"], "between hops": mean["between hops"],
                  "daemon trips": trips, **{f"server {phase}": server[phase] for phase in PHASES},
                  "not covered": mean["in flight"] - covered, "client after": mean["client after"],
                  "step": mean["step"], "step / local": mean["step"] / local,
                  "per-hop software cost": (mean["step"] - server["compute"] - trips) / 2}
        for row, value in column.items():
            rows.setdefault(row, []).append(value)
    for row, values in rows.items():
        print(f"  {row:<28}" + "".join(f"{value:>10.3f}" for value in values))
    print(f"  {'CPU (ms per step, mean)':<28}" + "".join(f"{mode:>10}" for mode in MODES))
    rounds = len(results[MODES_FIRST]["rounds"])
    for role in results[MODES_FIRST]["cpu"]:
        print(f"  {role:<28}" + "".join(f"{results[mode]['cpu'][role] / rounds * ms:>10.3f}" for mode in MODES))
    for mode in MODES:
        per_round = " ".join(f"{step * ms:.2f}" for step in results[mode]["rounds"])
        print(f"  step per round ({mode}): {per_round} ms")
    floor = summary(results["floor"])
    print("  floor: the same blocks through a lean chain of 2 processes (benchmarks/lean_chain.py), medians of "
          "steps paired with the same loop in one process")
    for row, value in floor.items():
        print(f"  {row:<28}{value:>10d}" if isinstance(value, int) else f"  {row:<28}{value:>10.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--prompt-tokens", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--echo-trips", type=int, default=200, help="echo round trips per round")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; 2 servers on 127.0.0.1; {args.rounds} rounds")
    for name in args.models:
        report(name, bench(name, args))


if __name__ == "__main__":
    main()
