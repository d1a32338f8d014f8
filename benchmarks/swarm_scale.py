"""A swarm under churn: servers killed and replaced while clients generate, every token checked.

Starts a bootstrap peer and N servers of a model on 127.0.0.1 (half with --blocks over fixed spans,
half with --num-blocks, which rebalance), then C client processes that generate greedily, one prompt
after another, without pause. Then, every few seconds for a fixed number of rounds, SIGKILLs a random
server (its records keep saying online until they expire) and starts a new --num-blocks server of
as many blocks in its place. Reports:
  - tokens checked against transformers' own model on the same weights (every one must be equal),
    generations that failed, and route changes (re-routes after a server failed, per generation);
  - the longest time any block had no live server serving it, judged from the processes themselves
    (alive, and their printed "online"/"moving" lines), not from the DHT;
  - moves of --num-blocks servers, and each server's DHT operations per minute (announces and lookups,
    with the block keys they stored or read, and liveness probes) from its own Prometheus counters;
  - memory per peer: the resident set of every process, its p2pd daemon counted apart;
  - with --relayed N: how many servers were behind NAT, the tokens of generations routed through
    one, and their relay failovers (a relay they held a slot on was killed);
beside transformers' local generation of the same prompts, timed in the same run.

    python benchmarks/swarm_scale.py                              # 16 servers of the demo model, 3 clients
    python benchmarks/swarm_scale.py --servers 8 --rounds 3       # the variant CI runs (tests/swarm/)

With --relayed N (default 4 where the machine allows: root, `ip netns`), the swarm runs in network
namespaces (benchmarks/nat_swarm.py): the last N servers each start behind a masquerading router
and reach the swarm through relays found on the DHT, and a killed one is replaced behind the same
router. With --relayed 0 every peer is direct, on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as a file: python benchmarks/swarm_scale.py
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.churn_watch import CoverageWatch, Scrapes, kill_a_range, memory, serving_span  # noqa: E402
from benchmarks.nat_swarm import NatSwarm, relay_figures, relayed_servers  # noqa: E402

FIXED_SPAN_SPLITS = (2, 3, 1)  # --blocks servers: the model split in 2, then in 3, then whole, and again
NUM_BLOCKS_CHOICES = (2, 3)  # --num-blocks K servers take K from these in turn (at most the model's blocks)
ROUTE_HOP = re.compile(r"(\w{8})\[\d+:\d+\]")  # a hop of a client's "Route for blocks" line: <peer id's end>[A:B]


@dataclass(frozen=True)
class ChurnConfig:
    servers: int = 16
    clients: int = 3
    rounds: int = 10  # kills (each followed at once by a new server)
    kill_every_s: float = 6.0
    settle_s: float = 20.0  # after the last kill, before the clients are stopped: they must still generate
    range_kill: bool = True  # last, kill every server of the least-served block, and time its re-coverage
    new_tokens: int = 16
    num_prompts: int = 6
    seed: int = 0
    server_args: tuple[str, ...] = ()
    relayed: int = 0  # of `servers`, the last ones start behind NAT (the swarm must be a NatSwarm)


@dataclass
class Report:
    servers: int = 0
    clients: int = 0
    kills: int = 0
    generations: int = 0
    failed: list[str] = field(default_factory=list)  # the errors of generations that failed
    tokens_checked: int = 0
    tokens_wrong: int = 0  # in generations whose tokens differ from transformers'
    route_changes: int = 0
    longest_uncovered_s: float = 0.0
    longest_uncovered_block: int | None = None
    range_killed: tuple[int, int] | None = None  # (block, servers killed) of the last round
    range_recovered_s: float | None = None  # until every block had a live server again (None: not within 120 s)
    moves: int = 0
    dht_per_minute: dict[str, list[float]] = field(default_factory=dict)  # figure -> one value per server
    rss_mib: dict[str, list[float]] = field(default_factory=dict)  # kind of peer -> one value per process
    swarm_generation_s: list[float] = field(default_factory=list)
    relayed: int = 0  # servers started behind NAT, replacements included
    relayed_unreachable: int = 0  # of them, those that said "NOT directly reachable" (so served through relays)
    relayed_tokens: int = 0  # exact tokens of generations routed through a relayed server
    relay_failovers_s: list[float] = field(default_factory=list)  # lost relay -> announced through another
    local_generation_s: list[float] = field(default_factory=list)


def fixed_spans(num_blocks: int) -> list[tuple[int, int]]:
    from bloompeer.peer.cli.local_swarm import split_blocks

    return [span for parts in FIXED_SPAN_SPLITS for span in split_blocks(num_blocks, parts)]


def make_prompts(vocab_size: int, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(rng.randint(4, 12))] for _ in range(count)]


def reference_tokens(reference, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], list[float]]:
    """transformers' greedy continuations of the prompts, and the seconds each took (on one thread, as
    servers decode: on a shared machine more threads mostly wait for each other)."""
    import torch

    tokens, seconds, threads = [], [], torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for prompt in prompts:
            started = time.perf_counter()
            with torch.inference_mode():
                output = reference.generate(torch.tensor([prompt]), max_new_tokens=new_tokens,
                                            min_new_tokens=new_tokens, do_sample=False)
            seconds.append(time.perf_counter() - started)
            tokens.append(output[0, len(prompt):].tolist())
    finally:
        torch.set_num_threads(threads)
    return tokens, seconds


def run_churn(swarm, model: Path, reference, config: ChurnConfig, work_dir: Path) -> Report:
    """The benchmark on `swarm` (a started LocalSwarm whose bootstrap peer the peers join): returns its figures.
    Every process it starts is stopped before it returns, also on failure."""
    from bloompeer.peer.cli.local_swarm import PeerProcess, stop_in_parallel

    rng = random.Random(config.seed)
    num_blocks = reference.config.num_hidden_layers
    prompts = make_prompts(reference.config.vocab_size, config.num_prompts, config.seed)
    expected, local_s = reference_tokens(reference, prompts, config.new_tokens)
    prompts_file = work_dir / "prompts.json"
    prompts_file.write_text(json.dumps(prompts))
    report = Report(servers=config.servers, clients=config.clients, local_generation_s=local_s)
    server_args = ("--metrics-port", "0", *config.server_args)
    spans, counts = fixed_spans(num_blocks), [min(k, num_blocks) for k in NUM_BLOCKS_CHOICES]
    servers, clients, killed, scrapes = [], [], set(), Scrapes()
    home_of: dict[int, str] = {}  # pid of a relayed server -> the home (behind NAT) it runs in
    client_program = (sys.executable, str(Path(__file__).resolve()))
    if config.relayed:
        scrapes.reach, client_program = swarm.scrape_context, swarm.program("public", client_program)

    def start_server(index: int, count: int | None = None, home: str | None = None):
        start, where = None, {} if home is None else {"home": home}
        if count is None and index % 2 == 0:
            start, end = spans[index // 2 % len(spans)]
            server = swarm.add_server(start, end, extra_args=server_args, wait=False, model=model,
                                      name=f"churn-server-{index}", **where)
        else:
            count = count or counts[index // 2 % len(counts)]
            server = swarm.add_server(None, None, extra_args=("--num-blocks", str(count), *server_args), wait=False,
                                      model=model, name=f"churn-server-{index}", **where)
        scrapes.started_at[server.pid] = time.monotonic()
        if home is not None:
            home_of[server.pid] = home
        if start is None:
            scrapes.rebalancing.add(server.pid)
        servers.append(server)
        return server

    watch = CoverageWatch(servers, killed, num_blocks)
    try:
        first_relayed, deadline = config.servers - config.relayed, time.monotonic() + 300
        for index in range(first_relayed):
            start_server(index)
        if config.relayed:  # the relays online first, so that the servers behind NAT find them in the records
            for server in servers:
                server.wait_online(deadline)
            for index in range(first_relayed, config.servers):
                start_server(index, home=swarm.homes[index - first_relayed])
        for server in servers[first_relayed if config.relayed else 0:]:
            server.wait_online(deadline)
        for index in range(config.clients):
            clients.append(PeerProcess(f"churn-client-{index}", [
                "--client", "--model", str(model), "--prompts", str(prompts_file), "--offset", str(index),
                "--new-tokens", str(config.new_tokens), "--initial-peers", *swarm.initial_peers],
                work_dir, program=client_program))
        for client in clients:
            client.wait_for_line("ready", deadline)
        watch.start()
        for round_index in range(config.rounds):
            time.sleep(config.kill_every_s)
            scrapes.take(servers)
            victim = rng.choice([s for s in servers if s.pid not in killed and serving_span(s)])
            start, end = serving_span(victim)
            victim.signal(signal.SIGKILL)
            killed.add(victim.pid)
            start_server(config.servers + round_index, count=end - start, home=home_of.get(victim.pid))
            report.kills += 1
        if config.range_kill:
            time.sleep(config.kill_every_s)
            block, count, report.range_recovered_s = kill_a_range(servers, killed, num_blocks)
            report.range_killed = (block, count)
        time.sleep(config.settle_s)
        scrapes.take(servers)
        started = [server for server in servers if server.pid not in killed  # not still loading
                   and any(line.startswith("online") for line in list(server.stdout))]
        report.rss_mib = memory({"server": started, "client": clients,
                                 "bootstrap": [swarm.bootstrap] if swarm.bootstrap else []})
    finally:
        report.longest_uncovered_s, report.longest_uncovered_block = watch.stop() if watch.is_alive() else (0.0, None)
        for client in clients:
            client.signal(signal.SIGTERM)  # each finishes the generation it is in, then exits
        for client in clients:
            try:
                client.process.wait(180)
            except Exception:
                client.signal(signal.SIGKILL)
        stop_in_parallel([*clients, *servers])
        for peer in (*clients, *servers):  # beside their logs (which hold stderr)
            (work_dir / f"{peer.name}.out").write_text("\n".join(peer.stdout))
    relayed = [server for server in servers if server.pid in home_of]
    relayed_ids = {_peer_id(server)[-8:] for server in relayed if _peer_id(server)}
    for client in clients:
        for line in client.stdout:
            if line.startswith("{"):
                _count_generation(report, json.loads(line), expected, relayed_ids)
    report.relayed = len(relayed)
    report.relayed_unreachable, report.relay_failovers_s = relay_figures(relayed)
    report.moves = scrapes.moves()
    report.dht_per_minute = scrapes.per_minute(min_age_s=30.0)
    return report


def _peer_id(server) -> str | None:
    return next((line.rsplit(" as ", 1)[1] for line in server.stdout if line.startswith("online:")), None)


def _count_generation(report: Report, result: dict, expected: list[list[int]], relayed_ids: set[str]) -> None:
    report.generations += 1
    report.route_changes += result["route_changes"]
    if result["error"] is not None:
        report.failed.append(result["error"])
        return
    report.swarm_generation_s.append(result["seconds"])
    if result["tokens"] == expected[result["prompt"]]:
        report.tokens_checked += len(result["tokens"])
        if relayed_ids & set(result["route_peers"]):
            report.relayed_tokens += len(result["tokens"])
    else:
        report.tokens_wrong += len(result["tokens"])


def _range_kill(report: Report) -> str:
    block, count = report.range_killed
    recovered = ("not served again within 120 s" if report.range_recovered_s is None
                 else f"every block served again after {report.range_recovered_s:.1f} s")
    return f"block {block}'s {count} server(s): {recovered}"


def _relay_rows(report: Report) -> list[tuple[str, str]]:
    failovers = report.relay_failovers_s
    took = f", announced again in median {statistics.median(failovers):.2f} s, max {max(failovers):.2f} s" \
        if failovers else ""
    return [("servers behind NAT (replacements included)",
             f"{report.relayed} ({report.relayed_unreachable} said NOT directly reachable)"),
            ("exact tokens of generations routed through one (any hop)", f"{report.relayed_tokens}"),
            ("relay failovers (a relay they held was killed)", f"{len(failovers)}{took}")]


def format_report(report: Report, config: ChurnConfig) -> str:
    def spread(values: list[float], unit: str = "") -> str:
        if not values:
            return "n/a"
        return f"median {statistics.median(values):.1f}{unit}, max {max(values):.1f}{unit} ({len(values)})"

    block = "" if report.longest_uncovered_block is None else f" (block {report.longest_uncovered_block})"
    rows = [
        ("servers / clients / kills", f"{report.servers} / {report.clients} / {report.kills} (one every "
                                      f"{config.kill_every_s:.0f} s, each replaced by a --num-blocks server"
                                      f"{', behind NAT if the killed one was' if config.relayed else ''})"),
        ("tokens equal to transformers'", f"{report.tokens_checked} of {report.tokens_checked + report.tokens_wrong}"),
        ("generations (failed)", f"{report.generations} ({len(report.failed)})"),
        ("route changes (re-routes after a failure)", str(report.route_changes)),
        ("longest time a block had no live server", f"{report.longest_uncovered_s:.1f} s{block}"),
        *([("every server of a block killed, at the end", _range_kill(report))] if report.range_killed else []),
        ("moves of --num-blocks servers", str(report.moves)),
        *(_relay_rows(report) if config.relayed else []),
        ("seconds per generation: swarm", spread(report.swarm_generation_s, " s")),
        ("seconds per generation: transformers, local", spread(report.local_generation_s, " s")),
        *((f"DHT per server per minute: {name}", spread(values)) for name, values in report.dht_per_minute.items()),
        *((f"RSS MiB: {kind}", spread(values)) for kind, values in sorted(report.rss_mib.items())),
    ]
    width = max(len(name) for name, _ in rows)
    lines = [f"| {'figure':<{width}} | value |", f"|{'-' * (width + 2)}|-------|"]
    lines += [f"| {name:<{width}} | {value} |" for name, value in rows]
    lines += [f"failed: {error}" for error in report.failed[:5]]
    return "\n".join(lines)


def client_main(args: argparse.Namespace) -> int:
    """One client: generate the prompts in turn until SIGTERM, a JSON line per generation."""
    import logging

    import torch

    from bloompeer import ClientConfig, DistributedBloomForCausalLM, NetworkConfig

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    routes = []

    class CountRoutes(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("Route for blocks"):
                routes.append(record)

    logging.basicConfig(format="%(asctime)s.%(msecs)03d %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("bloompeer").setLevel(logging.INFO)  # to the client's log file: routes, bans, waits
    logging.getLogger("bloompeer.peer.client.swarm").addHandler(CountRoutes())
    prompts = json.loads(Path(args.prompts).read_text())
    config = ClientConfig(NetworkConfig(initial_peers=tuple(args.initial_peers), client_mode=True))
    with DistributedBloomForCausalLM.from_pretrained(args.model, client_config=config) as model:
        print("ready", flush=True)
        index = args.offset
        while not stop.is_set():
            prompt, tokens, error = index % len(prompts), None, None
            routes.clear()
            started = time.perf_counter()
            try:
                with torch.inference_mode():
                    output = model.generate(torch.tensor([prompts[prompt]]), max_new_tokens=args.new_tokens,
                                            min_new_tokens=args.new_tokens, do_sample=False)
                tokens = output[0, len(prompts[prompt]):].tolist()
            except Exception as exc:  # reported, and the client goes on as a user would
                error = f"{type(exc).__name__}: {exc}"
            seconds = time.perf_counter() - started
            route_peers = sorted({peer for record in routes for peer in ROUTE_HOP.findall(record.getMessage())})
            print(json.dumps({"prompt": prompt, "tokens": tokens, "error": error, "seconds": seconds,
                              "route_changes": max(0, len(routes) - 1), "route_peers": route_peers}), flush=True)
            index += 1
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the bundled demo model)")
    parser.add_argument("--servers", type=int, default=ChurnConfig.servers, help="servers at start, half --num-blocks")
    parser.add_argument("--clients", type=int, default=ChurnConfig.clients, help="client processes generating")
    parser.add_argument("--rounds", type=int, default=ChurnConfig.rounds, help="servers killed and replaced")
    parser.add_argument("--kill-every", type=float, default=ChurnConfig.kill_every_s, metavar="SECONDS")
    parser.add_argument("--settle", type=float, default=ChurnConfig.settle_s, metavar="SECONDS",
                        help="how long the clients go on after the last kill")
    parser.add_argument("--no-range-kill", action="store_true",
                        help="do not kill every server of a block at the end")
    parser.add_argument("--new-tokens", type=int, default=ChurnConfig.new_tokens, help="per generation")
    parser.add_argument("--relayed", type=int, default=None, metavar="N",
                        help="servers behind NAT, in network namespaces (default: 4 where the machine allows)")
    parser.add_argument("--seed", type=int, default=ChurnConfig.seed, help="of the prompts and of who is killed")
    parser.add_argument("--logs", metavar="DIR", help="keep every peer's log here (default: deleted at the end)")
    parser.add_argument("--client", action="store_true", help=argparse.SUPPRESS)  # the client processes' mode
    parser.add_argument("--prompts", help=argparse.SUPPRESS)
    parser.add_argument("--offset", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--initial-peers", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        return client_main(args)

    import torch
    from transformers import AutoModelForCausalLM

    from bloompeer.peer.cli.default_model import DEMO_MODEL_DIR
    from bloompeer.peer.cli.local_swarm import LocalSwarm

    model = Path(args.model or DEMO_MODEL_DIR)
    config = ChurnConfig(servers=args.servers, clients=args.clients, rounds=args.rounds, kill_every_s=args.kill_every,
                         settle_s=args.settle, range_kill=not args.no_range_kill, new_tokens=args.new_tokens,
                         seed=args.seed, relayed=relayed_servers(args.relayed, args.servers))
    reference = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="swarm-scale-") as temporary:
        work_dir = Path(args.logs or temporary)
        swarm = NatSwarm(model, config.relayed, work_dir) if config.relayed else LocalSwarm(model, [], log_dir=work_dir)
        with swarm:
            report = run_churn(swarm, model, reference, config, work_dir)
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}, {time.monotonic() - started:.0f} s in all")
    print(format_report(report, config))
    return 0 if not report.failed and not report.tokens_wrong else 1


if __name__ == "__main__":
    sys.exit(main())
