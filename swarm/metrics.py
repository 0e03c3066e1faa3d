"""Prometheus metrics: the one way a process of the swarm serves them (`--metrics-port`), and the buckets all use.

Every metric is named `chainswarm_...`. Each process keeps its own `CollectorRegistry`, so tests that run several
servers or clients in one process never mix their numbers.
"""

from __future__ import annotations

import logging
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server

log = logging.getLogger(__name__)

# seconds: a decode step of a small model on CPU takes ~1 ms per block; a long prefill or a WAN chain seconds
SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
COUNT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


def serve_metrics(registry: CollectorRegistry, port: int, host: str = "0.0.0.0") -> Any:
    """Serves `registry` as Prometheus text at `http://host:port/metrics` from a daemon thread; gives the HTTP
    server (its `server_address` holds the port, if `port` was 0)."""
    server, _thread = start_http_server(port, addr=host, registry=registry)
    log.info("Prometheus metrics on http://%s:%d/metrics", host, server.server_address[1])
    return server
