"""What a server tells Prometheus: its metrics, and the HTTP endpoint that serves them (`--metrics-port`).

Every metric is defined here, in a registry of the server's own (never prometheus_client's global
one, so two servers in one process, as in tests, keep apart). Counters and histograms are updated
on the event loop where requests are answered and passes complete; gauges are read when scraped,
from the live session registry, cache budget and queue. The endpoint runs in prometheus_client's
own HTTP server thread, so a scrape never waits for the event loop or the compute thread.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from ...p2p import ErrorCode
from .step_clock import PHASES

__all__ = ["MetricsEndpoint", "ServerMetrics", "REQUEST_KINDS", "OK"]

logger = logging.getLogger(__name__)

OK = "ok"  # the `code` label of a request that was answered without an error
# a frame's kind is its message type; anything else is counted as "invalid" (bounded label values)
REQUEST_KINDS = frozenset({"open", "step", "close", "push", "forward", "backward", "info"})
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
PHASE_BUCKETS_S = (2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)


@dataclass(frozen=True)
class LiveState:
    """Readers of what the gauges show, called at each scrape (from the endpoint's thread)."""

    open_sessions: Callable[[], int]
    cache_tokens_used: Callable[[], int]
    cache_bytes_used: Callable[[], int]
    cache_tokens_free: Callable[[], int]
    queue_depth: Callable[[], int]


class ServerMetrics:
    """The server's counters, histograms and gauges, in their own CollectorRegistry."""

    def __init__(self):
        self.registry = CollectorRegistry(auto_describe=True)
        prefix = "bloompeer_server"
        self.tokens = Counter(f"{prefix}_tokens", "Tokens (batch rows x new tokens) computed through the served "
                              "blocks, by kind of work: inference, forward, backward",
                              ["kind"], registry=self.registry)
        self.requests = Counter(f"{prefix}_requests", "Requests answered, by kind (open, step, close, push, "
                                "forward, backward, info, invalid) and code (ok, or the error frame's code)",
                                ["kind", "code"], registry=self.registry)
        self.step_latency = Histogram(f"{prefix}_step_latency_seconds", "Time from receiving an inference step "
                                      "to its output being ready, queueing included", buckets=LATENCY_BUCKETS_S,
                                      registry=self.registry)
        self.step_phases = Histogram(f"{prefix}_step_phase_seconds", "Where an answered inference step's time "
                                     "went, by phase: decode, queue, compute, resume, encode (step_clock.py says "
                                     "what each covers)", ["phase"], buckets=PHASE_BUCKETS_S, registry=self.registry)
        self.batch_size = Histogram(f"{prefix}_batch_size", "Requests computed together in one pass through the "
                                    "blocks (steps of different sessions share a pass)", buckets=BATCH_BUCKETS,
                                    registry=self.registry)
        self.moves = Counter(f"{prefix}_moves", "Moves to other blocks (--num-blocks servers go where the swarm "
                             "needs them)", registry=self.registry)
        self.rebalance_checks = Counter(f"{prefix}_rebalance_checks", "Looks at the swarm for where blocks are "
                                        "needed (--num-blocks servers, every period)", registry=self.registry)
        self.probes = Counter(f"{prefix}_liveness_probes", "Servers asked whether they serve what their records say "
                              "(while looking where blocks are needed), by answer: answered, silent",
                              ["answer"], registry=self.registry)
        self.dht = Counter(f"{prefix}_dht_operations", "DHT operations this server started, by kind: announce "
                           "(storing its record under each of its blocks), lookup (reading every block's records)",
                           ["kind"], registry=self.registry)
        self.dht_keys = Counter(f"{prefix}_dht_keys", "Block keys those DHT operations stored or read, by kind",
                                ["kind"], registry=self.registry)
        self._gauges = {
            name: Gauge(f"{prefix}_{name}", text, registry=self.registry) for name, text in {
                "open_sessions": "Inference sessions open now",
                "cache_tokens_used": "Attention cache reserved by open sessions, in tokens over the served blocks",
                "cache_tokens_free": "Attention cache free for new sessions, in tokens over the served blocks",
                "cache_bytes_used": "Session cache reserved by open sessions, in bytes: keys and values for every "
                                    "token of a session's max_length, and a recurrent block's state per session",
                "queue_depth": "Requests waiting for the compute thread",
            }.items()
        }
        for kind in ("inference", "forward", "backward"):
            self.tokens.labels(kind)  # present (at 0) from the first scrape on
        for kind in ("announce", "lookup"):
            self.dht.labels(kind)
            self.dht_keys.labels(kind)
        for answer in ("answered", "silent"):
            self.probes.labels(answer)
        for phase in PHASES:
            self.step_phases.labels(phase)

    def watch(self, state: LiveState) -> None:
        """Let the gauges read the server's live state at each scrape."""
        for name, gauge in self._gauges.items():
            gauge.set_function(getattr(state, name))

    def count_request(self, kind: str, code: ErrorCode | str = OK) -> None:
        kind = kind if kind in REQUEST_KINDS else "invalid"
        self.requests.labels(kind, code.value if isinstance(code, ErrorCode) else code).inc()

    def count_dht(self, kind: str, keys: int) -> None:
        """One DHT operation of ours: "announce" (a store under `keys` block keys) or "lookup" (a read)."""
        self.dht.labels(kind).inc()
        self.dht_keys.labels(kind).inc(keys)

    def count_probe(self, answered: bool) -> None:
        self.probes.labels("answered" if answered else "silent").inc()

    def count_rebalance_check(self) -> None:
        self.rebalance_checks.inc()

    def observe_step_phases(self, phases: dict[str, float]) -> None:
        for phase, seconds in phases.items():
            self.step_phases.labels(phase).observe(seconds)

    def count_pass(self, kind: str, requests: int, rows: int) -> None:
        """One pass of the compute thread: `requests` together, `rows` tokens computed."""
        self.tokens.labels(kind).inc(rows)
        self.batch_size.observe(requests)


class MetricsEndpoint:
    """`GET /metrics` on host:port, served by prometheus_client's HTTP server in a thread of its own."""

    def __init__(self, metrics: ServerMetrics, host: str, port: int):
        try:
            self._httpd, self._thread = start_http_server(port, host, metrics.registry)
        except OSError as exc:
            raise OSError(f"could not serve metrics on {host}:{port}: {exc.strerror or exc}; "
                          f"pick another --metrics-port") from exc
        self.host, self.port = host, self._httpd.server_address[1]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and free the port. Idempotent."""
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._thread.join()
            self._httpd = None
