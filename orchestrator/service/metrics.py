"""The orchestrator's Prometheus metrics (`swarm-orchestrator --metrics-port`), read from its live state on scrape."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from orchestrator.service.orchestrator import Orchestrator


class OrchestratorMetrics(Collector):
    """The metrics of one `Orchestrator`, in a registry of their own."""

    def __init__(self, orchestrator: Orchestrator) -> None:
        self.orchestrator = orchestrator
        self.registry = CollectorRegistry()
        self.registry.register(self)

    def describe(self) -> Iterator[Metric]:
        return iter(())  # collected on demand

    def collect(self) -> Iterator[Metric]:
        state = self.orchestrator.state()
        for name, value, about in (
            ("active", int(bool(state["active"])), "1 while this orchestrator is the model's active one"),
            ("queue_length", state["queued"], "Sessions waiting in JFFC's central queue for a free chain"),
            ("leases", state["leases"], "Chains leased to sessions now"),
            ("arrival_rate", state["arrival_rate"], "Sessions per second asking for a chain (measured)"),
            ("chains", len(state["chains"]), "Chains of the current plan"),
            ("servers", len(state["blocks"]), "Servers the current plan places"),
        ):
            gauge = GaugeMetricFamily(f"chainswarm_orchestrator_{name}", about)
            gauge.add_metric([], value)
            yield gauge
        dispatched = CounterMetricFamily("chainswarm_orchestrator_dispatches", "Sessions given a chain (JFFC)")
        dispatched.add_metric([], state["dispatched"])
        yield dispatched
        capacity = GaugeMetricFamily("chainswarm_orchestrator_chain_capacity", "Sessions a chain serves at once",
                                     labels=["chain"])
        in_use = GaugeMetricFamily("chainswarm_orchestrator_chain_in_use", "Sessions a chain serves now",
                                   labels=["chain"])
        for index, chain in enumerate(state["chains"]):
            capacity.add_metric([str(index)], chain["capacity"])
            in_use.add_metric([str(index)], chain["in_use"])
        yield capacity
        yield in_use
