"""RTT matrices DERIVED from the RIPE Atlas EU anchor data, as the chain-composition paper's simulator derives them.

The data (`ripe_atlas_eu_rtt.csv`, see `shared/data/README.md`) holds, per anchor, RTTs to four vantage points
(`latency_m1..m4`) and the anchor's position; it holds no anchor-to-anchor RTTs. The paper builds them as

    RTT(i, j) = base(i) + base(j) + k * great_circle_km(i, j),   base(a) = 0.3 * median RTT of anchor a,
    k = 0.01 ms/km,

where the anchor's median RTT is taken over all its `latency_m*` samples (every row and column of that anchor).
Every figure resting on such a matrix is about this derived matrix, not about measured anchor-to-anchor RTTs.
"""

from __future__ import annotations

import csv
import math
import random
import statistics
from dataclasses import dataclass
from pathlib import Path

from netem.topology import Topology, TopologyError

BASE_FACTOR = 0.3
MS_PER_KM = 0.01
EARTH_RADIUS_KM = 6371.0
LATENCY_COLUMNS = ("latency_m1", "latency_m2", "latency_m3", "latency_m4")


def default_data_path() -> Path:
    """Gives where the shared data lives next to this checkout (`../shared/data/ripe_atlas_eu_rtt.csv`)."""
    return Path(__file__).resolve().parents[2] / "shared" / "data" / "ripe_atlas_eu_rtt.csv"


@dataclass(frozen=True)
class Anchor:
    """One RIPE Atlas anchor: its id, its median RTT to the vantage points and its position."""

    anchor_id: int
    median_rtt_ms: float
    latitude: float
    longitude: float


def great_circle_km(a: Anchor, b: Anchor) -> float:
    """Gives the haversine distance between two anchors in km."""
    lat1, lon1, lat2, lon2 = map(math.radians, (a.latitude, a.longitude, b.latitude, b.longitude))
    h = math.sin((lat2 - lat1) / 2) ** 2 + math.cos(lat1) * math.cos(lat2) * math.sin((lon2 - lon1) / 2) ** 2
    return 2 * EARTH_RADIUS_KM * math.asin(math.sqrt(h))


def load_anchors(path: str | Path) -> list[Anchor]:
    """Gives the anchors of the CSV, sorted by id, each with the median of all its latency samples."""
    samples: dict[int, list[float]] = {}
    positions: dict[int, tuple[float, float]] = {}
    with open(path, newline="") as file:
        for row in csv.DictReader(file):
            anchor_id = int(row["anchor_id"])
            samples.setdefault(anchor_id, []).extend(float(row[c]) for c in LATENCY_COLUMNS if row.get(c))
            positions.setdefault(anchor_id, (float(row["latitude"]), float(row["longitude"])))
    return [
        Anchor(anchor_id, statistics.median(values), *positions[anchor_id])
        for anchor_id, values in sorted(samples.items())
        if values
    ]


def derived_rtt_ms(a: Anchor, b: Anchor, *, base_factor: float = BASE_FACTOR, ms_per_km: float = MS_PER_KM) -> float:
    """Gives the paper's derived RTT between two anchors in ms."""
    if a.anchor_id == b.anchor_id:
        return 0.0
    return base_factor * (a.median_rtt_ms + b.median_rtt_ms) + ms_per_km * great_circle_km(a, b)


def from_ripe_atlas(
    count: int,
    *,
    seed: int,
    path: str | Path | None = None,
    hosts: list[str] | None = None,
    base_factor: float = BASE_FACTOR,
    ms_per_km: float = MS_PER_KM,
) -> Topology:
    """Gives `count` anchors sampled with `seed` and the RTT matrix derived between them (see the module doc).

    Hosts are named `a<anchor_id>` unless `hosts` names them (the i-th name takes the i-th sampled anchor).
    """
    path = Path(path) if path is not None else default_data_path()
    if not path.is_file():
        raise FileNotFoundError(f"RIPE Atlas data not found at {path} (see shared/data/README.md)")
    anchors = load_anchors(path)
    if not 1 <= count <= len(anchors):
        raise TopologyError(f"the data has {len(anchors)} anchors; asked for {count}")
    chosen = sorted(random.Random(seed).sample(anchors, count), key=lambda anchor: anchor.anchor_id)
    rtt = [[round(derived_rtt_ms(a, b, base_factor=base_factor, ms_per_km=ms_per_km), 3) for b in chosen]
           for a in chosen]
    names = hosts if hosts is not None else [f"a{anchor.anchor_id}" for anchor in chosen]
    ids = ",".join(str(anchor.anchor_id) for anchor in chosen)
    source = (
        f"derived from RIPE Atlas EU anchors {ids} (seed {seed}): RTT = {base_factor:g}*median(i) + "
        f"{base_factor:g}*median(j) + {ms_per_km:g} ms/km * great-circle km"
    )
    return Topology(tuple(names), rtt, source=source)
