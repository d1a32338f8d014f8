"""Decoding at internet distances: a swarm whose servers are each behind a delay proxy, and every way
the client can decode through it, side by side in one run, next to the physical floors.

Starts a bootstrap peer, N servers (real processes) splitting the model's blocks, and one process
of delay proxies (benchmarks/delay_proxy.py): each server listens on a port of its own and
announces its proxy's address (`serve --announce-maddrs`), so whoever dials it, the client or
another server pushing a step to it, goes through a delay of D ms each way. Before measuring it
checks that libp2p really dials the proxies: a ping from the client to each server, and every
round trip the servers announce between them, must take at least 2 D (a direct dial would take
about a millisecond); after the run, the proxies' byte counts must show server-to-server traffic.
It fails loudly otherwise.

Then, greedy on a held-out prompt, the same tokens for every row (checked against transformers):
  - no push: a round trip per server per token (floor: N x 2 D);
  - push: client -> server 1 -> ... -> server N -> client (floor: (N + 1) x D);
  - the default client (it chooses push, or not, per route, from the round trips it measures);
  - speculative decoding with the default client: a draft model, prompt lookup, and the target
    model as its own draft (every proposal accepted): tokens/s, effective time per token and the
    draft's acceptance rate;
and for each the time to first token (generate() to the first new token: a session opened on
every server, a round trip, then the prompt's step along the chain). For the push row it also
splits the step's time over its floor: each server's own time per step (from its /metrics), the
client's own time outside its call through the swarm, and the rest (the legs' daemons and
proxies, whose lateness the proxies count, and the frames' coding).

    python benchmarks/wan.py                                  # demo model, 3 servers, 50 ms one way
    python benchmarks/wan.py --model bloom-560m --servers 3   # random weights, the bloom-560m architecture
    python -m benchmarks.wan --delay-ms 0                     # one machine's loopback
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as a file: python benchmarks/wan.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
from transformers import AutoTokenizer, BloomForCausalLM
from transformers.generation.streamers import BaseStreamer

from benchmarks.delay_proxy import free_port
from bloompeer import ClientConfig, DistributedBloomForCausalLM, NetworkConfig
from bloompeer.p2p import ping
from bloompeer.peer.cli.default_model import DEMO_MODEL_DIR, write_random_checkpoint
from bloompeer.peer.cli.local_swarm import LocalSwarm, PeerProcess, split_blocks

RANDOM_MODELS = {  # --model NAME: random weights of this shape (write_random_checkpoint arguments)
    "tiny": dict(num_blocks=6, hidden_size=64, num_heads=4),
    "bloom-560m": dict(num_blocks=24, hidden_size=1024, num_heads=16, vocab_size=250880, max_shard_size="1GB"),
}
HELDOUT_TEXT = DEMO_MODEL_DIR / "heldout.txt"
DEMO_DRAFT_DIR = DEMO_MODEL_DIR / "draft"
RTT_SLACK = 0.98  # a proxied round trip takes at least 2 D; this allows for timer granularity


class Arrivals(BaseStreamer):
    """When generate() hands out new tokens, and how many each time (a verify pass may accept several)."""

    def __init__(self):
        self.started = time.perf_counter()
        self.times: list[float] = []
        self.counts: list[int] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # generate() first puts the prompt
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())
        self.counts.append(value.numel())

    def end(self) -> None:
        pass


class PassCounter:
    """Counts forward passes through the swarm after the prompt's, and the tokens each carried."""

    def __init__(self, model: torch.nn.Module):
        self.tokens: list[int] = []
        self._handle = model.register_forward_pre_hook(self._seen, with_kwargs=True)

    def _seen(self, module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.tokens.append(ids.shape[1])

    def close(self) -> None:
        self._handle.remove()


class SwarmCallTimer:
    """How long each call of the model's swarm part (embeddings, the steps through the servers,
    ln_f) took: a step's time outside it is the client's own (LM head, transformers' generate loop)."""

    def __init__(self, model: torch.nn.Module):
        self.durations_s: list[float] = []
        self._started = 0.0
        self._handles = [model.transformer.register_forward_pre_hook(self._start),
                         model.transformer.register_forward_hook(self._stop)]

    def _start(self, module, args) -> None:
        self._started = time.perf_counter()

    def _stop(self, module, args, output) -> None:
        self.durations_s.append(time.perf_counter() - self._started)

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()


@dataclass
class Row:
    name: str
    floor_s: float  # of one step through the swarm
    steps_s: list[float] = field(default_factory=list)  # gaps between token arrivals (a verify pass each)
    per_token_s: list[float] = field(default_factory=list)  # after the first token, per generate call
    ttft_s: list[float] = field(default_factory=list)
    swarm_calls_s: list[float] = field(default_factory=list)  # after the prompt's (see SwarmCallTimer)
    proposed: int = 0  # draft tokens sent for checking
    accepted: int = 0
    exact: bool = True
    speculative: bool = False
    note: str = ""


def generate_timed(model, prompt: torch.Tensor, new_tokens: int, row: Row, reference: list[int], **kwargs) -> None:
    """One greedy generate(): its token arrivals, passes and proposals go into `row`."""
    arrivals, passes, swarm_calls = Arrivals(), PassCounter(model), SwarmCallTimer(model)
    try:
        with torch.inference_mode():
            out = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                                 streamer=arrivals, pad_token_id=0, **kwargs)
    finally:
        passes.close()
        swarm_calls.close()
    row.swarm_calls_s += swarm_calls.durations_s[1:]
    row.exact &= out[0].tolist() == reference
    row.ttft_s.append(arrivals.times[0] - arrivals.started)
    row.steps_s += [b - a for a, b in zip(arrivals.times, arrivals.times[1:])]
    if len(arrivals.times) > 1:
        after_first = sum(arrivals.counts) - arrivals.counts[0]
        row.per_token_s.append((arrivals.times[-1] - arrivals.times[0]) / after_first)
    verify_passes = passes.tokens[1:]  # the first pass is the prompt's
    row.proposed += sum(n - 1 for n in verify_passes)
    row.accepted += sum(arrivals.counts[1:]) - len(verify_passes)  # each pass adds the target's own token


def client_config(swarm: LocalSwarm, push: bool | None) -> ClientConfig:
    return ClientConfig(NetworkConfig(initial_peers=tuple(swarm.initial_peers), client_mode=True), push=push)


def measure(path: Path, swarm: LocalSwarm, push: bool | None, rows: list[tuple[Row, dict]], prompt: torch.Tensor,
            reference: list[int], args: argparse.Namespace) -> None:
    """Every row in `rows` (with its extra generate arguments) on one client of the given push mode."""
    with DistributedBloomForCausalLM.from_pretrained(path, client_config=client_config(swarm, push)) as model:
        for row, kwargs in rows:
            print(f"  {row.name}...", file=sys.stderr, flush=True)
            warm_up = Row("warm-up", 0.0)
            generate_timed(model, prompt, 4, warm_up, reference, **kwargs)  # routes, streams
            for _ in range(args.repeats):
                generate_timed(model, prompt, args.new_tokens, row, reference, **kwargs)
        if push is None:
            rows[0][0].note = f"push chosen: {'yes' if chooses_push(model, prompt) else 'no'}"


def chooses_push(model, prompt: torch.Tensor) -> bool:
    """Whether a session of this client pushes, as its route choice decides."""
    with model.inference_session(prompt.shape[1] + 2) as session:
        model.client.runtime.run(session.open(batch=1))
        return bool(session.push)


def check_proxied(model, servers: list[PeerProcess], delay_s: float) -> None:
    """Fail unless the client's round trip to each server, and every round trip servers announce
    between them, took at least 2 D: proof that libp2p dialed the proxies."""
    rtts = {}
    for server in servers:
        model.client.runtime.run(ping(model.client.node.p2p, server.peer_id_str, 10.0))  # connection set up
        rtts[server.name] = model.client.runtime.run(ping(model.client.node.p2p, server.peer_id_str, 10.0))
    announced = {(record.peer_id, peer): rtt for records in model.client.swarm.servers.values() for record in records
                 for peer, rtt in record.push_rtts_s}
    too_fast = {name: rtt for name, rtt in rtts.items() if rtt < 2 * delay_s * RTT_SLACK}
    too_fast |= {f"{a[-6:]}->{b[-6:]}": rtt for (a, b), rtt in announced.items() if rtt < 2 * delay_s * RTT_SLACK}
    if too_fast:
        sys.exit(f"FAILED: round trips shorter than 2 x {1000 * delay_s:.0f} ms, so some connections bypass the "
                 f"delay proxies: {', '.join(f'{k} {1000 * v:.1f} ms' for k, v in too_fast.items())}")
    print(f"client -> server round trips through the proxies: "
          f"{', '.join(f'{1000 * v:.1f}' for v in rtts.values())} ms; announced server -> server: "
          f"{', '.join(f'{1000 * v:.1f}' for v in sorted(set(announced.values())))} ms "
          f"(each >= 2 x {1000 * delay_s:.0f} ms)")


def wait_for_push_rtts(model, servers: list[PeerProcess], timeout_s: float = 60.0) -> None:
    """Until each server announces round trips to the servers that start where it ends (their records
    come a few seconds after they are online)."""
    deadline = time.monotonic() + timeout_s
    while True:
        model.client.runtime.run(model.client.swarm.refresh())
        records = {r.peer_id: r for rs in model.client.swarm.servers.values() for r in rs}
        missing = [(a.peer_id, b.peer_id) for a in records.values() for b in records.values()
                   if b.start == a.end and a.push_rtt_s(b.peer_id) is None]
        if len(records) == len(servers) and not missing:
            return
        if time.monotonic() > deadline:
            sys.exit(f"FAILED: servers announced no round trips to their next hops within {timeout_s:.0f} s: {missing}")
        time.sleep(0.5)


def start_proxies(ports: list[tuple[int, int]], args: argparse.Namespace, log_dir: Path) -> PeerProcess:
    program = (sys.executable, str(Path(__file__).with_name("delay_proxy.py")))
    flags = ["--delay-ms", str(args.delay_ms)]
    if args.bandwidth_mbit:
        flags += ["--bandwidth-mbit", str(args.bandwidth_mbit)]
    proxies = PeerProcess("proxies", [*flags, *(f"{listen}:{target}" for listen, target in ports)], log_dir,
                          program=program)
    proxies.wait_for_line("ready", time.monotonic() + 30)
    return proxies


def proxy_counts(proxies: PeerProcess) -> dict:
    proxies.signal(signal.SIGTERM)
    counts = json.loads(proxies.wait_for_line("{", time.monotonic() + 30))
    proxies.stop()
    return counts


def server_to_server_bytes(counts: dict, server_ports: set[int]) -> int:
    """Bytes the proxies carried on connections that a server dialed (libp2p dials from its listening port)."""
    return sum(n for proxy in counts.values() for direction in ("up", "down")
               for port, n in proxy[direction].items() if int(port) in server_ports)


def server_step_totals(metrics_port: int) -> tuple[float, float]:
    """(seconds, steps) a server has spent computing inference steps, from receiving each to its
    output (its /metrics' step latency: checks, queue and compute; not the frames' coding)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    totals = dict(re.findall(r"^bloompeer_server_step_latency_seconds_(sum|count) (\S+)$", text, re.M))
    return float(totals["sum"]), float(totals["count"])


def chain_breakdown(row: Row, before: list[tuple[float, float]], after: list[tuple[float, float]]) -> str:
    """Where a pushed step's time over its floor went: each server's own time per step, the
    client's own time (outside its call through the swarm), and the rest (the legs' libp2p daemons
    and proxies, frame coding, the client's embeddings and its loop thread). The floor counts none."""
    per_server = [(a_sum - b_sum) / (a_count - b_count) for (b_sum, b_count), (a_sum, a_count) in zip(before, after)]
    step_s = statistics.median(row.steps_s)
    client_s = step_s - statistics.median(row.swarm_calls_s)
    rest_s = step_s - row.floor_s - sum(per_server) - client_s
    return (f"pushed step {_ms(step_s)} ms = floor {_ms(row.floor_s)} + the servers' own time per step "
            f"({' + '.join(_ms(s) for s in per_server)} ms, means from their /metrics, prompts included) "
            f"+ the client's outside its swarm call {_ms(client_s)} ms (LM head, generate loop) + the rest "
            f"{_ms(rest_s)} ms (legs through the daemons and proxies, frame coding, the client's embeddings "
            f"and loop thread)")


def proxy_lateness(counts: dict) -> str:
    """How far after their due time the proxies delivered chunks: what the floors leave out."""
    late = [proxy["late"] for proxy in counts.values() if proxy["late"]["chunks"]]
    chunks = sum(item["chunks"] for item in late)
    mean_us = sum(item["mean_us"] * item["chunks"] for item in late) / max(chunks, 1)
    return (f"the proxies delivered {chunks} chunks {mean_us:.0f} us after their due time on average "
            f"(at most {max((item['max_us'] for item in late), default=0) / 1000:.1f} ms)")


def model_path(args: argparse.Namespace, tmp: Path) -> Path:
    if args.model in RANDOM_MODELS:
        print(f"writing a random checkpoint of the {args.model} architecture...", file=sys.stderr, flush=True)
        return write_random_checkpoint(tmp / args.model, **RANDOM_MODELS[args.model])
    return Path(args.model)


def speculative_rows(args: argparse.Namespace, path: Path, target: BloomForCausalLM, push_floor_s: float):
    rows = []
    draft = args.draft_model or (DEMO_DRAFT_DIR if path.resolve() == DEMO_MODEL_DIR and DEMO_DRAFT_DIR.is_dir()
                                 else None)
    if draft is not None:
        assistant = BloomForCausalLM.from_pretrained(draft, dtype=torch.float32).eval()
        rows.append((Row(f"draft model ({Path(draft).name}, transformers' default proposals)", push_floor_s,
                         speculative=True),
                     dict(assistant_model=assistant)))
    else:
        print("note: no draft model for this checkpoint (the bundled draft is the demo model's; --draft-model "
              "PATH gives one): skipping that row")
    rows.append((Row(f"prompt lookup (k={args.prompt_lookup})", push_floor_s, speculative=True),
                 dict(prompt_lookup_num_tokens=args.prompt_lookup)))
    itself = copy.deepcopy(target)  # proposing k tokens every time: no confidence cut-off, as every one is right
    itself.generation_config.update(num_assistant_tokens=args.self_draft_tokens,
                                    num_assistant_tokens_schedule="constant", assistant_confidence_threshold=0.0)
    rows.append((Row(f"target as its own draft (k={args.self_draft_tokens})", push_floor_s, speculative=True),
                 dict(assistant_model=itself)))
    return rows


def _ms(seconds: float) -> str:
    return f"{1000 * seconds:.1f}"


def _row_line(row: Row, default_per_token_s: float | None, rtt_floor_s: float) -> str:
    """One table line; '-' where a row has no such figure (all its tokens came in one pass)."""
    name = f"{row.name}, {row.note}" if row.note else row.name
    step = per_token = "-"
    ratio = speed = relative = "-"
    if row.steps_s:
        median = statistics.median(row.steps_s)
        step = f"{_ms(median)} ({_ms(min(row.steps_s))}-{_ms(max(row.steps_s))})"
        ratio = f"{median / row.floor_s:.2f}" if row.floor_s else "-"
    if row.per_token_s:
        per_token_s = statistics.median(row.per_token_s)
        per_token, speed = _ms(per_token_s), f"{1 / per_token_s:.1f}"
        relative = f"{default_per_token_s / per_token_s:.2f}x" if default_per_token_s else "-"
    acceptance = f"{row.accepted / row.proposed:.0%} ({row.accepted}/{row.proposed})" \
        if row.speculative and row.proposed else "-"
    ttft = statistics.median(row.ttft_s)
    ttft_floor = rtt_floor_s + row.floor_s  # sessions open (one round trip, in parallel), then the prompt's step
    ttft_ratio = f" ({ttft / ttft_floor:.2f})" if ttft_floor else ""
    return (f"| {name} | {step} | {_ms(row.floor_s)} | {ratio} | {per_token} | {speed} | {relative} | {acceptance} "
            f"| {_ms(ttft)}{ttft_ratio} | {'yes' if row.exact else 'NO'} |")


def print_table(rows: list[Row], default: Row, rtt_floor_s: float) -> None:
    print("\n| row | step ms, median (min-max) | floor ms | ratio | ms/token | tokens/s | vs default "
          "| acceptance | first token ms (ratio) | exact |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    default_per_token_s = statistics.median(default.per_token_s) if default.per_token_s else None
    for row in rows:
        print(_row_line(row, default_per_token_s, rtt_floor_s))
    print("\nstep: time between token arrivals (a verify pass for speculative rows), floors for a step through "
          "the swarm; ms/token: generate() time after the first token per token after it; ratio: step / floor; "
          "first token floor: one round trip (sessions open) + the row's step floor; acceptance: of the draft "
          "tokens checked after the first pass (the prompt's)")


def run(args: argparse.Namespace, path: Path, log_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompt = tokenizer(HELDOUT_TEXT.read_text(), return_tensors="pt").input_ids[:, :args.prompt_tokens]
    target = BloomForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        reference = target.generate(prompt, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                    do_sample=False, pad_token_id=0)[0].tolist()
    num_blocks = target.config.n_layer
    spans = split_blocks(num_blocks, args.servers)
    delay_s, n = args.delay_ms / 1000, len(spans)
    rtt_floor_s, push_floor_s = n * 2 * delay_s, (n + 1) * delay_s
    ports = [(free_port(), free_port()) for _ in spans]  # (the proxy's, the server's)
    log_dir.mkdir(parents=True, exist_ok=True)
    proxies = start_proxies(ports, args, log_dir)
    try:
        with LocalSwarm(path, [], log_dir=log_dir) as swarm:
            metrics_ports = [free_port() for _ in spans]
            servers = [swarm.add_server(start, end, ["--host-maddrs", f"/ip4/127.0.0.1/tcp/{listen}",
                                                     "--announce-maddrs", f"/ip4/127.0.0.1/tcp/{proxy}",
                                                     "--metrics-port", str(metrics)], wait=False)
                       for (start, end), (proxy, listen), metrics in zip(spans, ports, metrics_ports)]
            for server in servers:
                server.wait_online(time.monotonic() + 180)
            print(f"{n} servers ({', '.join(f'{a}:{b}' for a, b in spans)}), {args.delay_ms:g} ms one way each, "
                  f"bandwidth {f'{args.bandwidth_mbit:g} Mbit/s' if args.bandwidth_mbit else 'not capped'}; "
                  f"load average {os.getloadavg()[0]:.2f}", flush=True)
            no_push, push = Row("no push", rtt_floor_s), Row("push", push_floor_s)
            default = Row("default client", push_floor_s)
            with DistributedBloomForCausalLM.from_pretrained(path, client_config=client_config(swarm, False)) as probe:
                wait_for_push_rtts(probe, servers)
                check_proxied(probe, servers, delay_s)
            print("measuring (each row: a warm-up, then --repeats generate calls)...", file=sys.stderr, flush=True)
            measure(path, swarm, False, [(no_push, {})], prompt, reference, args)
            before = [server_step_totals(port) for port in metrics_ports]
            measure(path, swarm, True, [(push, {})], prompt, reference, args)
            push_breakdown = chain_breakdown(push, before, [server_step_totals(port) for port in metrics_ports])
            spec = speculative_rows(args, path, target, push_floor_s)
            measure(path, swarm, None, [(default, {}), *spec], prompt, reference, args)
            if args.delay_ms == 0:
                for row in (no_push, push, default, *(row for row, _ in spec)):
                    row.floor_s = 0.0
    finally:
        counts = proxy_counts(proxies)
    pushed_bytes = server_to_server_bytes(counts, {listen for _, listen in ports})
    print(f"server-to-server bytes through the proxies: {pushed_bytes}; {proxy_lateness(counts)}")
    if n > 1 and pushed_bytes == 0:
        sys.exit("FAILED: no server-to-server traffic went through the proxies: pushes bypassed the delays")
    print_table([no_push, push, default, *(row for row, _ in spec)], default, 2 * delay_s)
    print(f"floors: a round trip per server {1000 * rtt_floor_s:.0f} ms; pushed along the chain "
          f"{1000 * push_floor_s:.0f} ms; load average at the end {os.getloadavg()[0]:.2f}")
    print(push_breakdown)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(DEMO_MODEL_DIR),
                        help=f"checkpoint directory, or {' / '.join(RANDOM_MODELS)} for random weights of that "
                             f"architecture (default: the demo model)")
    parser.add_argument("--servers", type=int, default=3)
    parser.add_argument("--delay-ms", type=float, default=50.0, help="one-way delay to each server (50)")
    parser.add_argument("--bandwidth-mbit", type=float, default=None, help="cap per connection and direction")
    parser.add_argument("--draft-model", default=None, metavar="PATH",
                        help=f"draft for speculative decoding (default: {DEMO_DRAFT_DIR} with the demo model)")
    parser.add_argument("--prompt-lookup", type=int, default=4, metavar="K")
    parser.add_argument("--self-draft-tokens", type=int, default=8, metavar="K",
                        help="tokens the target proposes per pass when it is its own draft (8)")
    parser.add_argument("--prompt-tokens", type=int, default=32, help="taken from the start of held-out text")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3, help="generate calls per row")
    args = parser.parse_args()
    # this process runs the client's LM head and the local drafts: one thread, as on a machine whose cores
    # are busy with the servers (with two, every small op waited on a descheduled thread: 20 ms a linear layer)
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} cores; "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bloompeer-wan-") as tmp:
        run(args, model_path(args, Path(tmp)), Path(tmp) / "logs")


if __name__ == "__main__":
    main()
