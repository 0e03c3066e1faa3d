"""A server's Prometheus metrics (`swarm-server --metrics-port`).

Histograms are observed as batches and steps finish (`BatchStats.observers`); everything else is read from the
server's own counters when Prometheus scrapes, so the numbers are the ones `info` reports.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from swarm.metrics import COUNT_BUCKETS, SECONDS_BUCKETS

if TYPE_CHECKING:
    from server.server import SwarmServer


class ServerMetrics(Collector):
    """The metrics of one `SwarmServer`, in a registry of their own."""

    def __init__(self, server: SwarmServer) -> None:
        self.server = server
        self.registry = CollectorRegistry()
        self.batch_seconds = Histogram("chainswarm_server_batch_seconds", "Compute time of one batch through the "
                                       "server's blocks", buckets=SECONDS_BUCKETS, registry=self.registry)
        self.batch_steps = Histogram("chainswarm_server_batch_size", "Steps (of any sessions) computed in one batch",
                                     buckets=COUNT_BUCKETS, registry=self.registry)
        self.batch_tokens = Histogram("chainswarm_server_batch_tokens", "Tokens computed in one batch",
                                      buckets=COUNT_BUCKETS, registry=self.registry)
        self.step_seconds = Histogram("chainswarm_server_step_seconds", "Time from a step's arrival to its answer",
                                      ["kind"], buckets=SECONDS_BUCKETS, registry=self.registry)
        self.tokens = Counter("chainswarm_server_tokens_computed", "Tokens computed through the server's blocks",
                              registry=self.registry)
        self.registry.register(self)
        server.scheduler.stats.observers.append(self.observe_batch)
        server.scheduler.step_observers.append(self.observe_step)

    def observe_batch(self, steps: int, tokens: int, compute_ms: float) -> None:
        self.batch_seconds.observe(compute_ms / 1000)
        self.batch_steps.observe(steps)
        self.batch_tokens.observe(tokens)
        self.tokens.inc(tokens)

    def observe_step(self, tokens: int, admitted_s: float) -> None:
        self.step_seconds.labels("decode" if tokens == 1 else "prefill").observe(time.perf_counter() - admitted_s)

    def describe(self) -> Iterator[Metric]:
        return iter(())  # collected on demand: nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        server = self.server
        stats = server.scheduler.stats
        pool = server.pool.stats()
        sessions = GaugeMetricFamily("chainswarm_server_sessions", "Sessions open on this server")
        sessions.add_metric([], len(server.sessions))
        yield sessions
        pages = GaugeMetricFamily("chainswarm_server_pages", "Pages of the memory pool by what holds them",
                                  labels=["kind"])
        for kind, count in (("params", pool.pages_params), ("kv", pool.pages_kv), ("free", pool.pages_free)):
            pages.add_metric([kind], count)
        yield pages
        blocks = GaugeMetricFamily("chainswarm_server_blocks", "Blocks this server hosts now")
        blocks.add_metric([], server.hosting.end - server.hosting.start)
        yield blocks
        steps = CounterMetricFamily("chainswarm_server_steps", "Steps computed, by where", labels=["place"])
        for place, count in sorted(stats.steps_by_place.items()):
            steps.add_metric([place], count)
        yield steps
        failed = CounterMetricFamily("chainswarm_server_steps_failed", "Steps that failed, by error code",
                                     labels=["code"])
        for code, count in sorted(stats.failed.items()):
            failed.add_metric([code], count)
        yield failed
        pushes = CounterMetricFamily("chainswarm_server_pushes", "Steps pushed to the next server of a chain, or "
                                     "received from the previous one", labels=["direction"])
        pusher = server.pusher
        pushes.add_metric(["sent"], pusher.sent if pusher is not None else 0)
        pushes.add_metric(["dropped"], pusher.dropped if pusher is not None else 0)
        pushes.add_metric(["received"], server.pushes_received)
        yield pushes
        migrations = CounterMetricFamily("chainswarm_server_migrations", "Sessions moved by migration",
                                         labels=["direction", "mode"])
        moved = server.migrations.stats
        for direction, counts in (("in", moved.sessions_in), ("out", moved.sessions_out)):
            for mode in ("kv", "replay"):
                migrations.add_metric([direction, mode], counts[mode])
        yield migrations
        migrated = CounterMetricFamily("chainswarm_server_migration_bytes", "KV bytes moved by migration",
                                       labels=["direction"])
        migrated.add_metric(["in"], moved.bytes_in)
        migrated.add_metric(["out"], moved.bytes_out)
        yield migrated
        for name, count, about in (("drops", server.hosting.drops, "Times blocks were dropped (KunServe)"),
                                   ("restores", server.hosting.restores, "Times dropped blocks were restored")):
            family = CounterMetricFamily(f"chainswarm_server_{name}", about)
            family.add_metric([], count)
            yield family
