"""Server throughput under concurrent sessions, with cross-session batching on and off, in one run.

For each model (random weights, written to a temp dir) and each batching mode, starts a bootstrap
peer and ONE server holding every block of the model on 127.0.0.1 (batching off is
`serve --max-batch-sessions 1`), then for N = 1, 2, 4, 8, 16 concurrent sessions measures:
  - aggregate steps/s: N x steps / wall time of the stepping phase;
  - per-session median step latency (the median over sessions of each session's median);
  - the server's peak RSS during that measurement (VmHWM of the server process, reset before each);
  - how many requests shared a pass on average (from the server's /metrics, `--metrics-port`).
Beside them, as the floor of the latency ratios, the same blocks in the benchmark's own process
after the servers are gone: a pass of one session's step and of the largest N's steps together.
Every N is measured once per round, in `--rounds` rounds on the same server: each figure is the median
over rounds, and each ratio to N = 1 the median of the ratios within a round, so that the machine's
drift (10-30 % within minutes here) moves a figure and its baseline together.
Two kinds of client drive the sessions:
  - light: one client process, N threads, each with its own inference session through the
    session API (`SwarmClient.open_session`, `InferenceSession.step`), sending random hidden states: nothing but
    the swarm's own work competes with the server for the cores (no embeddings, no LM head);
  - generate: N threads calling `generate` (greedy) on ONE distributed model, the way a
    program serving many users calls the Python API (the LM head runs in the client process).
Each session first sends a 16-token prompt (not timed), then `--steps` one-token steps (timed);
all sessions start stepping together.

    python benchmarks/throughput.py                           # tiny, bloom-560m and qwen3-0.6b architectures
    python benchmarks/throughput.py --models bloom-560m --clients light --sessions 1 8
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from prometheus_client.parser import text_string_to_metric_families
from transformers import LogitsProcessor, LogitsProcessorList

from bloompeer import AutoDistributedModelForCausalLM, ClientConfig, NetworkConfig
from bloompeer.blocks import Segment, open_checkpoint
from bloompeer.peer.client.swarm_client import SwarmClient
from bloompeer.peer.cli.default_model import write_random_checkpoint
from bloompeer.peer.cli.local_swarm import LocalSwarm

MODELS = {  # name -> write_random_checkpoint arguments: the server holds all of the model's blocks
    "tiny": dict(num_blocks=4, hidden_size=64, num_heads=4, vocab_size=260),
    "bloom-560m": dict(num_blocks=12, hidden_size=1024, num_heads=16, vocab_size=250880, max_shard_size="1GB"),
    # half of Qwen3-0.6B (14 of its 28 blocks): what one of two servers holds
    "qwen3-0.6b": dict(model_type="qwen3", num_blocks=14, hidden_size=1024, num_heads=16, num_key_value_heads=8,
                       head_dim=128, intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True,
                       max_shard_size="1GB"),
}
PROMPT_TOKENS = 16


@dataclass
class Result:
    steps_per_s: float
    median_step_ms: float
    peak_rss_mib: float
    requests_per_pass: float = float("nan")
    error: str | None = None


def _status_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


@contextmanager
def peak_rss(pid: int):
    """The process's peak RSS (MiB) while the block runs: VmHWM, reset first through clear_refs."""
    found = {}
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as clear:
            clear.write("5")  # resets the peak resident set size to the current one
    except OSError as exc:
        print(f"could not reset the server's peak RSS ({exc}); the figure is the peak since start",
              file=sys.stderr)
    yield found
    found["mib"] = _status_kib(pid, "VmHWM") / 1024


def _run_threads(count: int, target) -> list:
    """target(index, barrier) in `count` threads; returns each one's result (or exception)."""
    results: list = [None] * count
    barrier = threading.Barrier(count)

    def run(index: int) -> None:
        try:
            results[index] = target(index, barrier)
        except BaseException as exc:  # reported in the table, not raised: one row fails, not the run
            barrier.abort()
            results[index] = exc

    threads = [threading.Thread(target=run, args=(i,), name=f"session-{i}") for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def _summarise(results: list, steps: int, wall_s: float, rss_mib: float) -> Result:
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        return Result(float("nan"), float("nan"), rss_mib, error=f"{len(errors)} failed: {errors[0]!r}"[:160])
    return Result(len(results) * steps / wall_s, 1000 * statistics.median(statistics.median(r) for r in results),
                  rss_mib)


class PassCounter:
    """Requests and passes the server computed, from its Prometheus endpoint (batch size histogram)."""

    def __init__(self, url: str):
        self.url = url

    def totals(self) -> tuple[float, float]:
        with urllib.request.urlopen(self.url, timeout=30) as response:
            text = response.read().decode()
        samples = {sample.name: sample.value for family in text_string_to_metric_families(text)
                   for sample in family.samples if sample.name.startswith("bloompeer_server_batch_size")}
        return samples["bloompeer_server_batch_size_sum"], samples["bloompeer_server_batch_size_count"]

    @contextmanager
    def measure(self, result_holder: list):
        """Appends the mean requests per pass of what ran in the block to `result_holder`."""
        requests, passes = self.totals()
        yield
        requests_after, passes_after = self.totals()
        result_holder.append((requests_after - requests) / max(1.0, passes_after - passes))


def measured(counter: PassCounter, run, *args) -> Result:
    mean = []
    with counter.measure(mean):
        result = run(*args)
    result.requests_per_pass = mean[0]
    return result


def light_clients(swarm_client: SwarmClient, hidden_size: int, sessions: int, steps: int, pid: int) -> Result:
    """`sessions` threads, each stepping its own session with random hidden states."""
    starts: list[float] = []

    def drive(index: int, barrier: threading.Barrier) -> list[float]:
        generator = torch.Generator().manual_seed(index)
        session = swarm_client.open_session(max_length=PROMPT_TOKENS + steps)
        try:
            swarm_client.runtime.run(session.step(torch.randn(1, PROMPT_TOKENS, hidden_size, generator=generator)))
            tokens = [torch.randn(1, 1, hidden_size, generator=generator) for _ in range(steps)]
            barrier.wait()
            starts.append(time.perf_counter())
            times = []
            for hidden in tokens:
                begin = time.perf_counter()
                swarm_client.runtime.run(session.step(hidden))
                times.append(time.perf_counter() - begin)
            return times
        finally:
            swarm_client.close_session(session)

    with peak_rss(pid) as rss:
        results = _run_threads(sessions, drive)
    wall_s = time.perf_counter() - min(starts) if starts else float("nan")
    return _summarise(results, steps, wall_s, rss["mib"])


class _TokenClock(LogitsProcessor):
    """Waits at a barrier before the first decode step, then records when each token's logits are ready."""

    def __init__(self, barrier: threading.Barrier, starts: list[float]):
        self.barrier, self.starts, self.times = barrier, starts, []

    def __call__(self, input_ids, scores):
        if not self.times:  # the prompt's logits: every session has its prefill done before timing starts
            self.barrier.wait()
            self.starts.append(time.perf_counter())
        self.times.append(time.perf_counter())
        return scores


def generate_clients(model, vocab_size: int, sessions: int, steps: int,
                     pid: int) -> Result:
    """`sessions` threads calling generate on one model."""
    starts: list[float] = []

    def drive(index: int, barrier: threading.Barrier) -> list[float]:
        prompt = torch.randint(4, vocab_size, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(index))
        clock = _TokenClock(barrier, starts)
        model.generate(prompt, max_new_tokens=steps + 1, min_new_tokens=steps + 1, do_sample=False,
                       logits_processor=LogitsProcessorList([clock]), pad_token_id=0)
        return [b - a for a, b in zip(clock.times, clock.times[1:])]

    with peak_rss(pid) as rss:
        with torch.inference_mode():
            results = _run_threads(sessions, drive)
    wall_s = time.perf_counter() - min(starts) if starts else float("nan")
    return _summarise(results, steps, wall_s, rss["mib"])


def pass_floor(path: Path, num_blocks: int, sessions: int, rounds: int) -> tuple[float, float]:
    """Median ms of a pass of one session's one-token step and of `sessions` sessions' steps together,
    through every block in this process on every thread, with no server, network or client around it
    (interleaved over rounds). Their ratio is the least that N sessions' step latency can be relative
    to one session's, whatever the server and the network do."""
    span = open_checkpoint(path).load_span(0, num_blocks, torch.float32)
    span.use_batched_linears()
    with torch.inference_mode():
        caches = []
        for _ in range(sessions):
            cache = span.new_cache(0, num_blocks, 1, PROMPT_TOKENS + 64, torch.float32)
            span(torch.randn(1, PROMPT_TOKENS, span.config.hidden_size), cache.begin_step(0, None, PROMPT_TOKENS), cache)
            caches.append(cache)

        def step(count: int) -> float:
            segments = [Segment(torch.randn(1, 1, span.config.hidden_size), cache.begin_step(PROMPT_TOKENS, None, 1),
                                cache) for cache in caches[:count]]
            begin = time.perf_counter()
            span.forward_segments(segments)
            return time.perf_counter() - begin

        times = {1: [], sessions: []}
        for _ in range(rounds):
            for count in times:
                times[count] += [step(count) for _ in range(6)][1:]
    return tuple(1000 * statistics.median(times[count]) for count in (1, sessions))


def _rounds(args: argparse.Namespace):
    """(round, sessions) in the order measured: every N once per round, so that each N's figures and
    its ratio to N = 1 are taken over the same stretch of a machine that drifts by 10-30 % in minutes."""
    for round_index in range(args.rounds):
        for sessions in args.sessions:
            yield round_index, sessions


def bench_model(name: str, args: argparse.Namespace) -> tuple[dict[tuple[str, str, int], list[Result]], str]:
    """Every (clients, batching, N) measured over rounds, and the line that gives the floor (pass_floor)."""
    spec = MODELS[name]
    results = {}
    with tempfile.TemporaryDirectory(prefix=f"bloompeer-throughput-{name}-") as tmp:
        print(f"[{name}] writing a random checkpoint...", file=sys.stderr, flush=True)
        path = write_random_checkpoint(Path(tmp) / name, **spec)
        for batching in ("on", "off"):
            server_args = ["--max-length", str(PROMPT_TOKENS + args.steps + 8), "--metrics-port", "0"]
            if batching == "off":
                server_args += ["--max-batch-sessions", "1"]
            print(f"[{name}] starting one server of {spec['num_blocks']} blocks, batching {batching}...",
                  file=sys.stderr, flush=True)
            with LocalSwarm(path, [(0, spec["num_blocks"])], server_args=server_args) as swarm:
                pid = swarm.servers[0].pid
                counter = PassCounter(next(line.split(" ", 1)[1] for line in swarm.servers[0].stdout
                                           if line.startswith("metrics: ")))
                config = ClientConfig(NetworkConfig(initial_peers=tuple(swarm.initial_peers), client_mode=True),
                                      request_timeout_s=120.0)
                if "light" in args.clients:
                    client = SwarmClient.connect(open_checkpoint(path), config)
                    try:
                        light_clients(client, spec["hidden_size"], 1, 4, pid)  # warm-up: route, connections
                        for round_index, sessions in _rounds(args):
                            result = measured(counter, light_clients, client, spec["hidden_size"], sessions,
                                              args.steps, pid)
                            results.setdefault(("light", batching, sessions), []).append(result)
                            _progress(name, "light", batching, sessions, round_index, result)
                    finally:
                        client.shutdown()
                if "generate" in args.clients:
                    with AutoDistributedModelForCausalLM.from_pretrained(path, client_config=config) as model:
                        generate_clients(model, spec["vocab_size"], 1, 4, pid)  # warm-up
                        for round_index, sessions in _rounds(args):
                            result = measured(counter, generate_clients, model, spec["vocab_size"], sessions,
                                              args.steps, pid)
                            results.setdefault(("generate", batching, sessions), []).append(result)
                            _progress(name, "generate", batching, sessions, round_index, result)
        largest = max(args.sessions)
        print(f"[{name}] in-process passes of 1 and {largest} sessions...", file=sys.stderr, flush=True)
        one, many = pass_floor(path, spec["num_blocks"], largest, args.rounds)
    return results, f"in this process alone (no server, network or client), a pass of one session's step takes " \
                    f"{one:.1f} ms and of {largest} sessions' steps {many:.1f} ms: {many / one:.2f}x, the floor of " \
                    f"the step latency ratio at N = {largest}"


def _progress(name: str, clients: str, batching: str, sessions: int, round_index: int, result: Result) -> None:
    print(f"[{name}] round {round_index + 1}: {clients} batching {batching} N={sessions}: {result}", file=sys.stderr,
          flush=True)


def _ratios(results: list[Result], bases: list[Result]) -> tuple[list[float], list[float]]:
    """Per round: steps/s and step latency relative to N = 1 of the same round."""
    pairs = list(zip(results, bases))
    return ([r.steps_per_s / b.steps_per_s for r, b in pairs], [r.median_step_ms / b.median_step_ms for r, b in pairs])


def print_table(name: str, results: dict[tuple[str, str, int], list[Result]]) -> None:
    """A markdown table, one row per (clients, N): batching on and off side by side. Each figure is the
    median over rounds; each x the median over rounds of the ratio to N = 1 in the same round. The
    per-round ratios of batching on follow the table."""
    print(f"\n{name}: aggregate steps/s and per-session median step latency (x: relative to N = 1), requests per "
          f"pass, server peak RSS; medians of {len(next(iter(results.values())))} rounds")
    print("| clients | N | on: steps/s | on: step ms | on: req/pass | on: RSS MiB | off: steps/s | off: step ms "
          "| off: RSS MiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    per_round = []
    for clients in ("light", "generate"):
        for sessions in sorted({n for c, _, n in results if c == clients}):
            cells = []
            for batching in ("on", "off"):
                rounds, bases = results.get((clients, batching, sessions), []), results.get((clients, batching, 1), [])
                failed = next((r.error for r in [*rounds, *bases] if r.error), None)
                if failed or not rounds:
                    cells += [failed or "-", "", "", ""][:4 if batching == "on" else 3]
                    continue
                speedups, slowdowns = _ratios(rounds, bases)
                cells += [f"{statistics.median(r.steps_per_s for r in rounds):.1f} ({statistics.median(speedups):.2f}x)",
                          f"{statistics.median(r.median_step_ms for r in rounds):.1f} "
                          f"({statistics.median(slowdowns):.2f}x)"]
                if batching == "on":
                    cells.append(f"{statistics.median(r.requests_per_pass for r in rounds):.1f}")
                    if sessions != 1:
                        per_round.append(f"{clients} N={sessions}, batching on, per round: steps/s "
                                         + " ".join(f"{x:.2f}x" for x in speedups) + "; step latency "
                                         + " ".join(f"{x:.2f}x" for x in slowdowns))
                cells.append(f"{max(r.peak_rss_mib for r in rounds):.0f}")
            print(f"| {clients} | {sessions} | " + " | ".join(cells) + " |", flush=True)
    print("\n".join(per_round), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--clients", nargs="+", default=["light", "generate"], choices=["light", "generate"])
    parser.add_argument("--sessions", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    parser.add_argument("--steps", type=int, default=32, help="timed one-token steps per session")
    parser.add_argument("--rounds", type=int, default=3,
                        help="measure every N this many times, interleaved; figures are medians over rounds")
    args = parser.parse_args()
    if 1 not in args.sessions:
        args.sessions = [1, *args.sessions]  # the baseline of the ratios
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; one server and its clients on 127.0.0.1")
    for name in args.models:
        results, floor = bench_model(name, args)
        print_table(name, results)
        print(floor, flush=True)


if __name__ == "__main__":
    main()
