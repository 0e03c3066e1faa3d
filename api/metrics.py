"""`swarm-api`'s Prometheus metrics, served at its own `/metrics`: HTTP requests by route and status, their
durations, time to first token, tokens generated, generations running and the swarm sessions' failovers."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from swarm.metrics import SECONDS_BUCKETS


class ApiMetrics:
    """The metrics of one `swarm-api` process, in a registry of their own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("chainswarm_api_requests", "HTTP requests answered, by route and status",
                                ["route", "status"], registry=self.registry)
        self.request_seconds = Histogram("chainswarm_api_request_seconds", "Time to answer an HTTP request (a "
                                         "stream: to its last event)", ["route"], buckets=SECONDS_BUCKETS,
                                         registry=self.registry)
        self.first_token_seconds = Histogram("chainswarm_api_time_to_first_token_seconds", "Time from a "
                                             "generation's start to its first token", buckets=SECONDS_BUCKETS,
                                             registry=self.registry)
        self.tokens = Counter("chainswarm_api_tokens_generated", "Tokens generated for requests",
                              registry=self.registry)
        self.generations = Gauge("chainswarm_api_generations", "Generations running now", registry=self.registry)
        self.failovers = Counter("chainswarm_api_failovers", "Times a generation's session replaced a server of its "
                                 "chain (and replayed)", registry=self.registry)
