"""Reading the Prometheus text a process of the swarm serves (its `metrics http://...` line names the URL)."""

from __future__ import annotations

import httpx2 as httpx
from prometheus_client.parser import text_string_to_metric_families

from swarm.local_swarm import Proc, SwarmProcesses


def metrics_url(swarm: SwarmProcesses, proc: Proc) -> str:
    return swarm.wait_for_line(proc, "metrics http://").split()[1]


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Gives every sample at `url`, by (name, sorted labels)."""
    response = httpx.get(url, timeout=30)
    response.raise_for_status()
    assert response.headers["content-type"].startswith("text/plain")
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(response.text) for sample in family.samples}


def value(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    """Gives one sample's value (KeyError if it is not there)."""
    return samples[(name, tuple(sorted(labels.items())))]
