"""Topology spec of an emulated network: hosts, a pairwise RTT matrix in ms, optional bandwidth per host and loss.

Built from a JSON or CSV file, or generated with a seed (uniform RTTs, or random-geometric placement); the
RIPE Atlas derivation lives in `netem.ripe`. JSON format (the one `swarm-netem up --topology` reads):

    {"hosts": ["h0", "h1", "h2"], "rtt_ms": [[0, 20, 40], [20, 0, 60], [40, 60, 0]],
     "bandwidth_mbit": {"h0": 100}, "loss_pct": 0.5}

`bandwidth_mbit` limits a host's access link in each direction; `loss_pct` (a number for every pair, or a
matrix) is the chance in percent that a packet is dropped on its way from row host to column host.
"""

from __future__ import annotations

import csv
import io
import json
import math
import random
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MAX_HOSTS = 250  # one /24 of host addresses (netem.netns.host_address)
MAX_RTT_MS = 10_000.0
HOST_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,39}$")

Matrix = tuple[tuple[float, ...], ...]


class TopologyError(ValueError):
    """A topology spec that cannot be emulated, with what is wrong in it."""


def _matrix(rows: Sequence[Sequence[float]], size: int, what: str) -> Matrix:
    if len(rows) != size or any(len(row) != size for row in rows):
        raise TopologyError(f"{what} must be a {size}x{size} matrix (one row and column per host)")
    try:
        matrix = tuple(tuple(float(value) for value in row) for row in rows)
    except (TypeError, ValueError) as error:
        raise TopologyError(f"{what} holds a value that is not a number: {error}") from None
    if not all(math.isfinite(value) for row in matrix for value in row):
        raise TopologyError(f"{what} holds a value that is not finite")
    return matrix


@dataclass(frozen=True)
class Topology:
    """Hosts and what the network between them does; validated on construction."""

    hosts: tuple[str, ...]
    rtt_ms: Matrix
    bandwidth_mbit: Mapping[str, float] = field(default_factory=dict)
    loss_pct: Matrix | None = None
    source: str = ""  # where the numbers come from, e.g. "derived from RIPE Atlas ..." (said in every report)

    def __post_init__(self) -> None:
        hosts = tuple(self.hosts)
        object.__setattr__(self, "hosts", hosts)
        if not 1 <= len(hosts) <= MAX_HOSTS:
            raise TopologyError(f"a topology needs 1 to {MAX_HOSTS} hosts, got {len(hosts)}")
        for host in hosts:
            if not isinstance(host, str) or not HOST_NAME.match(host):
                raise TopologyError(f"host name {host!r} must match {HOST_NAME.pattern}")
        if len(set(hosts)) != len(hosts):
            raise TopologyError("host names must be unique")
        rtt = _matrix(self.rtt_ms, len(hosts), "rtt_ms")
        object.__setattr__(self, "rtt_ms", rtt)
        for i, row in enumerate(rtt):
            if row[i] != 0:
                raise TopologyError(f"rtt_ms[{i}][{i}] must be 0 (a host reaches itself over loopback)")
            for j, value in enumerate(row):
                if not 0 <= value <= MAX_RTT_MS:
                    raise TopologyError(f"rtt_ms[{i}][{j}] = {value} is outside 0..{MAX_RTT_MS} ms")
                if abs(value - rtt[j][i]) > 1e-9:
                    raise TopologyError(f"rtt_ms must be symmetric: [{i}][{j}] = {value} but [{j}][{i}] = {rtt[j][i]}")
        bandwidth = dict(self.bandwidth_mbit)
        for host, mbit in bandwidth.items():
            if host not in hosts:
                raise TopologyError(f"bandwidth_mbit names {host!r}, which is not a host")
            if not (isinstance(mbit, int | float) and math.isfinite(mbit) and mbit > 0):
                raise TopologyError(f"bandwidth_mbit[{host!r}] must be a positive number of Mbit/s, got {mbit!r}")
        object.__setattr__(self, "bandwidth_mbit", {host: float(mbit) for host, mbit in bandwidth.items()})
        if self.loss_pct is not None:
            loss = _matrix(self.loss_pct, len(hosts), "loss_pct")
            if not all(0 <= value < 100 for row in loss for value in row):
                raise TopologyError("loss_pct values must be in [0, 100)")
            object.__setattr__(self, "loss_pct", loss if any(any(row) for row in loss) else None)

    @property
    def size(self) -> int:
        return len(self.hosts)

    def index(self, host: str) -> int:
        """Gives the position of `host` in `hosts`."""
        try:
            return self.hosts.index(host)
        except ValueError:
            raise TopologyError(f"no host {host!r} in this topology (hosts: {', '.join(self.hosts)})") from None

    def rtt(self, a: str, b: str) -> float:
        """Gives the target RTT between hosts `a` and `b` in ms."""
        return self.rtt_ms[self.index(a)][self.index(b)]

    def scaled(self, factor: float) -> Topology:
        """Gives the same topology with every RTT multiplied by `factor`."""
        rtt = [[value * factor for value in row] for row in self.rtt_ms]
        return Topology(self.hosts, rtt, self.bandwidth_mbit, self.loss_pct, f"{self.source} (RTTs x{factor:g})")

    def to_dict(self) -> dict[str, Any]:
        """Gives the JSON form (the file format `from_dict` reads)."""
        spec: dict[str, Any] = {"hosts": list(self.hosts), "rtt_ms": [list(row) for row in self.rtt_ms]}
        if self.bandwidth_mbit:
            spec["bandwidth_mbit"] = dict(self.bandwidth_mbit)
        if self.loss_pct is not None:
            spec["loss_pct"] = [list(row) for row in self.loss_pct]
        if self.source:
            spec["source"] = self.source
        return spec

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_dict(cls, spec: Mapping[str, Any]) -> Topology:
        """Gives the topology of a parsed JSON spec."""
        if not isinstance(spec, Mapping) or "hosts" not in spec or "rtt_ms" not in spec:
            raise TopologyError('a topology needs "hosts" and "rtt_ms"')
        unknown = set(spec) - {"hosts", "rtt_ms", "bandwidth_mbit", "loss_pct", "source"}
        if unknown:
            raise TopologyError(f"unknown topology keys: {', '.join(sorted(unknown))}")
        hosts = spec["hosts"]
        if not isinstance(hosts, list):
            raise TopologyError('"hosts" must be a list of names')
        loss = spec.get("loss_pct")
        if isinstance(loss, int | float):
            loss = [[0.0 if i == j else float(loss) for j in range(len(hosts))] for i in range(len(hosts))]
        bandwidth = spec.get("bandwidth_mbit") or {}
        if not isinstance(bandwidth, Mapping):
            raise TopologyError('"bandwidth_mbit" must map host names to Mbit/s')
        return cls(tuple(hosts), spec["rtt_ms"], bandwidth, loss, str(spec.get("source", "")))

    @classmethod
    def from_json(cls, text: str) -> Topology:
        try:
            return cls.from_dict(json.loads(text))
        except json.JSONDecodeError as error:
            raise TopologyError(f"not valid JSON: {error}") from None

    @classmethod
    def from_csv(cls, text: str) -> Topology:
        """Gives the topology of a CSV file: a square matrix with a header row of host names
        (`host,h0,h1` then `h0,0,20`), or an edge list with header `a,b,rtt_ms` (pairs not listed are errors)."""
        rows = [row for row in csv.reader(io.StringIO(text)) if row and any(cell.strip() for cell in row)]
        if len(rows) < 2:
            raise TopologyError("a topology CSV needs a header row and at least one data row")
        header = [cell.strip() for cell in rows[0]]
        if [cell.lower() for cell in header[:3]] == ["a", "b", "rtt_ms"]:
            return cls._from_edge_rows(rows[1:])
        hosts = header[1:]
        body = rows[1:]
        if [row[0].strip() for row in body] != hosts:
            raise TopologyError("the first column of a matrix CSV must list the hosts in header order")
        return cls(tuple(hosts), [[float(cell) for cell in row[1:]] for row in body], source="CSV matrix")

    @classmethod
    def _from_edge_rows(cls, rows: list[list[str]]) -> Topology:
        hosts: list[str] = []
        edges: dict[tuple[str, str], float] = {}
        for row in rows:
            a, b, value = (cell.strip() for cell in row[:3])
            for host in (a, b):
                if host not in hosts:
                    hosts.append(host)
            edges[a, b] = edges[b, a] = float(value)
        missing = [(a, b) for a in hosts for b in hosts if a < b and (a, b) not in edges]
        if missing:
            raise TopologyError(f"the edge list gives no RTT for {len(missing)} pair(s), e.g. {missing[0]}")
        rtt = [[0.0 if a == b else edges[a, b] for b in hosts] for a in hosts]
        return cls(tuple(hosts), rtt, source="CSV edge list")

    @classmethod
    def from_file(cls, path: str | Path) -> Topology:
        """Gives the topology in a `.json` or `.csv` file."""
        path = Path(path)
        text = path.read_text()
        topology = cls.from_csv(text) if path.suffix.lower() == ".csv" else cls.from_json(text)
        return topology if topology.source else Topology(
            topology.hosts, topology.rtt_ms, topology.bandwidth_mbit, topology.loss_pct, f"file {path.name}"
        )


def host_names(count: int, prefix: str = "h") -> tuple[str, ...]:
    return tuple(f"{prefix}{i}" for i in range(count))


def uniform(count: int, *, min_ms: float, max_ms: float, seed: int, hosts: Sequence[str] | None = None) -> Topology:
    """Gives `count` hosts whose pairwise RTTs are drawn uniformly from [min_ms, max_ms] (seeded)."""
    if not 0 <= min_ms <= max_ms:
        raise TopologyError(f"need 0 <= min_ms <= max_ms, got {min_ms}, {max_ms}")
    rng = random.Random(seed)
    rtt = [[0.0] * count for _ in range(count)]
    for i in range(count):
        for j in range(i + 1, count):
            rtt[i][j] = rtt[j][i] = round(rng.uniform(min_ms, max_ms), 3)
    names = tuple(hosts) if hosts is not None else host_names(count)
    return Topology(names, rtt, source=f"uniform RTTs in [{min_ms:g}, {max_ms:g}] ms, seed {seed}")


def random_geometric(
    count: int, *, min_ms: float, max_ms: float, seed: int, hosts: Sequence[str] | None = None
) -> Topology:
    """Gives `count` hosts placed uniformly in a unit square (seeded): RTT = min_ms + (max_ms - min_ms) * distance
    / sqrt(2), so the matrix obeys the triangle inequality like distances on a map."""
    if not 0 <= min_ms <= max_ms:
        raise TopologyError(f"need 0 <= min_ms <= max_ms, got {min_ms}, {max_ms}")
    rng = random.Random(seed)
    points = [(rng.random(), rng.random()) for _ in range(count)]
    rtt = [
        [0.0 if i == j else round(min_ms + (max_ms - min_ms) * math.dist(p, q) / math.sqrt(2), 3) for j, q in
         enumerate(points)]
        for i, p in enumerate(points)
    ]
    names = tuple(hosts) if hosts is not None else host_names(count)
    return Topology(names, rtt, source=f"random-geometric RTTs in [{min_ms:g}, {max_ms:g}] ms, seed {seed}")


def constant(hosts: Sequence[str], rtt_ms: float, *, mbit: float | None = None) -> Topology:
    """Gives `hosts` with the same RTT between every pair (0 for an undelayed baseline), and with `mbit`, every
    host's access link limited to that rate."""
    rtt = [[0.0 if i == j else float(rtt_ms) for j in range(len(hosts))] for i in range(len(hosts))]
    if mbit is None:
        return Topology(tuple(hosts), rtt, source=f"every pair {rtt_ms:g} ms")
    return Topology(tuple(hosts), rtt, {host: mbit for host in hosts},
                    source=f"every pair {rtt_ms:g} ms, {mbit:g} Mbit/s")
