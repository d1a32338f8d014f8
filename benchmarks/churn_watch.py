"""What benchmarks/swarm_scale.py watches in a swarm under churn, from outside its processes: which
blocks a live server serves now (from each server's printed "online"/"moving" lines), how long a
block went without one, each server's Prometheus counters, and every process's resident memory."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = ["CoverageWatch", "Scrapes", "covered_blocks", "kill_a_range", "memory", "serving_span"]


def serving_span(server) -> tuple[int, int] | None:
    """The blocks a server process serves now, by its last "online"/"moving" line (None: none yet, or moving)."""
    for line in reversed(list(server.stdout)):
        if line.startswith("moving:"):
            return None
        if line.startswith("online:"):
            start, end = line.split(" blocks ", 1)[1].split()[0].split(":")
            return int(start), int(end)
    return None


def covered_blocks(servers: Sequence, killed: set[int]) -> set[int]:
    """Blocks that a live server serves now."""
    covered = set()
    for server in list(servers):
        if server.pid not in killed and server.process.poll() is None and (span := serving_span(server)):
            covered.update(range(*span))
    return covered


def kill_a_range(servers: Sequence, killed: set[int], num_blocks: int,
                 timeout_s: float = 120.0) -> tuple[int, int, float | None]:
    """SIGKILL every server of the block with the fewest servers; (the block, how many were killed, seconds
    until every block had a live server again, or None if not within `timeout_s`)."""
    live = [server for server in servers if server.pid not in killed and serving_span(server)]
    holders = {block: [server for server in live if block in range(*serving_span(server))]
               for block in range(num_blocks)}
    block = min(holders, key=lambda index: (len(holders[index]), index))
    for server in holders[block]:
        server.signal(signal.SIGKILL)
        killed.add(server.pid)
    killed_at = time.monotonic()
    while len(covered_blocks(servers, killed)) < num_blocks:
        if time.monotonic() - killed_at > timeout_s:
            return block, len(holders[block]), None
        time.sleep(0.05)
    return block, len(holders[block]), time.monotonic() - killed_at


class CoverageWatch(threading.Thread):
    """Every 50 ms: which blocks a live server serves now; the longest a block went without one."""

    def __init__(self, servers: list, killed: set[int], num_blocks: int):
        super().__init__(daemon=True, name="coverage-watch")
        self.servers, self.killed, self.num_blocks = servers, killed, num_blocks
        self.uncovered_since: dict[int, float] = {}
        self.longest: dict[int, float] = {}
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(0.05):
            self.look()

    def look(self) -> None:
        now, covered = time.monotonic(), covered_blocks(self.servers, self.killed)
        for block in range(self.num_blocks):
            if block in covered and block in self.uncovered_since:
                gap = now - self.uncovered_since.pop(block)
                self.longest[block] = max(self.longest.get(block, 0.0), gap)
            elif block not in covered:
                self.uncovered_since.setdefault(block, now)

    def stop(self) -> tuple[float, int | None]:
        """(the longest time without a server, its block), counting gaps still open now."""
        self.stopped.set()
        self.join()
        now = time.monotonic()
        for block, since in self.uncovered_since.items():
            self.longest[block] = max(self.longest.get(block, 0.0), now - since)
        if not self.longest:
            return 0.0, None
        block = max(self.longest, key=self.longest.get)
        return self.longest[block], block


def rss_mib(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def children(pid: int) -> list[int]:
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(proc.name))
            except (OSError, IndexError, ValueError):
                continue
    return found


def memory(peers: dict[str, list]) -> dict[str, list[float]]:
    """Kind of peer -> RSS (MiB) of each live process of that kind; "<kind> p2pd" for their daemons."""
    figures: dict[str, list[float]] = {}
    for kind, processes in peers.items():
        for peer in processes:
            if peer.process.poll() is not None:
                continue
            figures.setdefault(f"{kind} (python)", []).append(rss_mib(peer.pid))
            for child in children(peer.pid):
                figures.setdefault(f"{kind} (p2pd)", []).append(rss_mib(child))
    return figures


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


DHT_FIGURES = {  # figure -> (metric, labels)
    "announces": ("bloompeer_server_dht_operations_total", (("kind", "announce"),)),
    "keys stored": ("bloompeer_server_dht_keys_total", (("kind", "announce"),)),
    "lookups": ("bloompeer_server_dht_operations_total", (("kind", "lookup"),)),
    "keys read": ("bloompeer_server_dht_keys_total", (("kind", "lookup"),)),
    "liveness probes (--num-blocks servers)": ("bloompeer_server_liveness_probes_total", (("answer", "answered"),)),
    "probes unanswered (--num-blocks servers)": ("bloompeer_server_liveness_probes_total", (("answer", "silent"),)),
}


class Scrapes:
    """Each server's latest counters (scraped while it lives: a killed one cannot be asked), and its age then."""

    def __init__(self):
        self.latest: dict[int, tuple[float, dict]] = {}  # pid -> (seconds since its start, samples)
        self.started_at: dict[int, float] = {}
        self.rebalancing: set[int] = set()  # pids of --num-blocks servers (only they look for gaps)
        self.reach: Callable[[int], contextlib.AbstractContextManager] = lambda pid: contextlib.nullcontext()

    def take(self, servers: Sequence) -> None:
        for server in servers:
            urls = [line.split(": ", 1)[1] for line in list(server.stdout) if line.startswith("metrics: ")]
            if server.process.poll() is None and urls:
                try:
                    with self.reach(server.pid):  # where its metrics port can be reached from
                        samples = scrape(urls[0])
                    self.latest[server.pid] = (time.monotonic() - self.started_at[server.pid], samples)
                except OSError:
                    continue

    def per_minute(self, min_age_s: float) -> dict[str, list[float]]:
        """Figure -> its rate of each server that lived at least `min_age_s` (probes: --num-blocks servers)."""
        figures: dict[str, list[float]] = {name: [] for name in DHT_FIGURES}
        for pid, (age_s, samples) in self.latest.items():
            if age_s >= min_age_s:
                for name, key in DHT_FIGURES.items():
                    if "probes" not in name or pid in self.rebalancing:
                        figures[name].append(60 * samples.get(key, 0.0) / age_s)
        return figures

    def moves(self) -> int:
        return int(sum(samples.get(("bloompeer_server_moves_total", ()), 0.0) for _, samples in self.latest.values()))
