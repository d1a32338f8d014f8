"""The API's Prometheus metrics, served at GET /metrics of the API's own port.

Names follow Prometheus conventions: the `bloompeer_api_` prefix, `_total` counters, seconds.
A registry of the app's own (not prometheus_client's global one), so that two apps in one
process never share counters. Latencies are measured on the generation thread, when transformers
hands over each token.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["ApiMetrics", "RequestTimer"]

# a token through a swarm takes from a few ms (one machine) to seconds (far servers, big models)
LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class ApiMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "bloompeer_api_requests", "HTTP requests answered, by endpoint and status code",
            ["endpoint", "code"], registry=self.registry)
        self.prompt_tokens = Counter(
            "bloompeer_api_prompt_tokens", "Prompt tokens of the generations started", ["model"],
            registry=self.registry)
        self.generated_tokens = Counter(
            "bloompeer_api_generated_tokens", "Tokens generated through the swarm", ["model"],
            registry=self.registry)
        self.scoring_passes = Counter(
            "bloompeer_api_scoring_passes", "Forward passes through the swarm that scored a batch of prompts (echo "
                                            "with logprobs, or max_tokens 0 or 1)", ["model"], registry=self.registry)
        self.generations = Counter(
            "bloompeer_api_generations", "Choices ended, by reason: stop, length, disconnect (the client "
                                         "left mid-generation), error", ["model", "reason"], registry=self.registry)
        self.in_progress = Gauge(
            "bloompeer_api_generations_in_progress", "Generations running or waiting for a thread", ["model"],
            registry=self.registry)
        self.busy_threads = Gauge(
            "bloompeer_api_busy_threads", "Generation threads (at most --max-concurrent) running a generation or a "
                                          "scoring pass through the swarm now; a request whose client left stops "
                                          "counting once its work is cancelled", registry=self.registry)
        self.time_to_first_token = Histogram(
            "bloompeer_api_time_to_first_token_seconds", "From a generation's start (request accepted) to its "
                                                         "first token", ["model"], buckets=LATENCY_BUCKETS_S,
            registry=self.registry)
        self.inter_token_latency = Histogram(
            "bloompeer_api_inter_token_latency_seconds", "Between two consecutive tokens of one generation",
            ["model"], buckets=LATENCY_BUCKETS_S, registry=self.registry)

    def exposition(self) -> tuple[bytes, str]:
        """The text format Prometheus scrapes, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def timer(self, model: str, started_at: float) -> RequestTimer:
        return RequestTimer(self, model, started_at)


class RequestTimer:
    """Observes one generation's token times (called on the generation thread, once per token)."""

    def __init__(self, metrics: ApiMetrics, model: str, started_at: float):
        self.metrics, self.model, self._last_at = metrics, model, None
        self._started_at = started_at

    def __call__(self, at: float) -> None:
        if self._last_at is None:
            self.metrics.time_to_first_token.labels(self.model).observe(at - self._started_at)
        else:
            self.metrics.inter_token_latency.labels(self.model).observe(at - self._last_at)
        self._last_at = at
        self.metrics.generated_tokens.labels(self.model).inc()
