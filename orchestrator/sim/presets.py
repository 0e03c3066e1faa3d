"""The paper's simulation settings (Sec. 4.1): BLOOM-176B, two GPU types, RIPE-derived RTTs, J, eta, lambda, rho_bar.

tau_p = t_o + (F / flops) l_in + (s_m / mem_bw) (l_out - 1) with t_o = 1 ms, F = 5 GFLOP per block per token,
l_in = 2000, l_out = 20: 109 ms on the 40 GB / 120 TFLOPS / 1.02 GB/ms server, 175 ms on the 20 GB / 80 TFLOPS /
0.51 GB/ms one. tau_c[j] = RTT(orchestrator, j) + 18 ms.

The RTT matrix is DERIVED, not measured pairwise: RIPE Atlas gives each European anchor's RTTs to four vantage
points; as in the paper authors' simulator, RTT(i, j) = 0.3 median(i) + 0.3 median(j) + 0.01 ms/km * great-circle
km(i, j). Without the RIPE file a synthetic matrix of the same form is used, and every result says which.
"""

from __future__ import annotations

import csv
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from orchestrator.swarm_model import ModelSpec, ServerSpec, SwarmModel, per_ms

BLOOM_176B = ModelSpec(blocks=70, block_gb=1.32, cache_gb=0.11)
INPUT_TOKENS, OUTPUT_TOKENS = 2000, 20
OVERHEAD_PER_BLOCK_MS = 1.0
GFLOP_PER_BLOCK_TOKEN = 5.0
COMM_OVERHEAD_MS = 18.0
DEFAULT_SERVERS, DEFAULT_ETA = 20, 0.2
DEFAULT_RATE_PER_S, DEFAULT_RHO_BAR = 0.2, 0.7
RTT_BASE_SHARE, RTT_MS_PER_KM = 0.3, 0.01
DATA_DIR = Path(__file__).resolve().parents[3] / "shared" / "data"
RIPE_FILE = DATA_DIR / "ripe_atlas_eu_rtt.csv"


@dataclass(frozen=True)
class GpuType:
    """A server type of Sec. 4.1: memory, compute and memory bandwidth."""

    name: str
    memory_gb: float
    tflops: float
    mem_bw_gb_per_ms: float


HIGH_PERFORMANCE = GpuType("A100 3g.40gb", 40.0, 120.0, 1.02)
LOW_PERFORMANCE = GpuType("A100 2g.20gb", 20.0, 80.0, 0.51)


def per_block_time_ms(gpu: GpuType, input_tokens, output_tokens, block_gb: float = BLOOM_176B.block_gb):
    """Gives tau_p: one job's time through one block (prefill compute-bound, decode memory-bound); arrays work."""
    prefill_ms_per_token = GFLOP_PER_BLOCK_TOKEN / (gpu.tflops * 1000.0) * 1000.0  # GFLOP / (GFLOP/ms)
    decode_ms_per_token = block_gb / gpu.mem_bw_gb_per_ms
    return OVERHEAD_PER_BLOCK_MS + prefill_ms_per_token * input_tokens + decode_ms_per_token * (output_tokens - 1)


@dataclass(frozen=True)
class RttMatrix:
    """Round-trip times between candidate node locations, in ms, and where they come from."""

    rtt_ms: np.ndarray
    source: str

    @property
    def nodes(self) -> int:
        return int(self.rtt_ms.shape[0])


def _great_circle_km(lat: np.ndarray, lon: np.ndarray) -> np.ndarray:
    lat, lon = np.radians(lat), np.radians(lon)
    dlat = lat[:, None] - lat[None, :]
    dlon = lon[:, None] - lon[None, :]
    a = np.sin(dlat / 2) ** 2 + np.cos(lat[:, None]) * np.cos(lat[None, :]) * np.sin(dlon / 2) ** 2
    return 2 * 6371.0 * np.arctan2(np.sqrt(a), np.sqrt(np.clip(1 - a, 0.0, None)))


def _derived_matrix(median_ms: np.ndarray, lat: np.ndarray, lon: np.ndarray) -> np.ndarray:
    base = RTT_BASE_SHARE * median_ms
    matrix = base[:, None] + base[None, :] + RTT_MS_PER_KM * _great_circle_km(lat, lon)
    np.fill_diagonal(matrix, 0.0)
    return matrix


def load_ripe_rtt(path: str | Path = RIPE_FILE) -> RttMatrix:
    """Gives the RTT matrix derived from RIPE Atlas anchors (median RTT per anchor + great-circle distance)."""
    path = Path(path)
    samples: dict[int, list[float]] = {}
    where: dict[int, tuple[float, float]] = {}
    with path.open(newline="") as handle:
        for row in csv.DictReader(handle):
            anchor = int(row["anchor_id"])
            values = [float(row[f"latency_m{i}"]) for i in range(1, 5) if row.get(f"latency_m{i}", "") != ""]
            samples.setdefault(anchor, []).extend(v for v in values if v > 0 and math.isfinite(v))
            where.setdefault(anchor, (float(row["latitude"]), float(row["longitude"])))
    anchors = sorted(a for a in samples if samples[a])
    if len(anchors) < 2:
        raise ValueError(f"{path}: fewer than two anchors with RTT samples")
    median = np.array([float(np.median(samples[a])) for a in anchors])
    lat = np.array([where[a][0] for a in anchors])
    lon = np.array([where[a][1] for a in anchors])
    return RttMatrix(_derived_matrix(median, lat, lon), f"derived from RIPE Atlas ({len(anchors)} EU anchors)")


def synthetic_rtt(nodes: int = 320, seed: int = 0) -> RttMatrix:
    """Gives an RTT matrix of the same form from made-up anchors spread over Europe (when RIPE data is absent)."""
    rng = np.random.default_rng([seed, 7])
    median = rng.uniform(2.0, 40.0, size=nodes)
    lat, lon = rng.uniform(36.0, 60.0, size=nodes), rng.uniform(-9.0, 30.0, size=nodes)
    return RttMatrix(_derived_matrix(median, lat, lon), "SYNTHETIC (RIPE Atlas file not found)")


def default_rtt(path: str | Path | None = None) -> RttMatrix:
    """Gives the RIPE-derived matrix from `path` (or ../shared/data), or the synthetic one if there is no file."""
    if path is not None:
        return load_ripe_rtt(path)
    return load_ripe_rtt(RIPE_FILE) if RIPE_FILE.exists() else synthetic_rtt()


@dataclass(frozen=True)
class PaperInstance:
    """One random swarm of Sec. 4.1: the swarm, which servers are high-performance, and the RTT source."""

    swarm: SwarmModel
    high_performance: tuple[str, ...]
    rtt_source: str
    orchestrator_node: int


def paper_swarm(
    servers: int = DEFAULT_SERVERS, eta: float = DEFAULT_ETA, seed: int = 0, rtt: RttMatrix | None = None
) -> PaperInstance:
    """Gives a Sec. 4.1 swarm: orchestrator and J servers at random RTT nodes, round(eta J) random fast servers."""
    if servers < 1 or not 0.0 <= eta <= 1.0:
        raise ValueError("need at least one server and 0 <= eta <= 1")
    rtt = rtt or default_rtt()
    if servers + 1 > rtt.nodes:
        raise ValueError(f"{servers} servers and an orchestrator need {servers + 1} RTT nodes; have {rtt.nodes}")
    rng = np.random.default_rng([seed, 11])
    nodes = rng.choice(rtt.nodes, size=servers + 1, replace=False)
    fast = set(rng.choice(servers, size=round(eta * servers), replace=False).tolist())
    tau_p_fast = float(per_block_time_ms(HIGH_PERFORMANCE, INPUT_TOKENS, OUTPUT_TOKENS))
    tau_p_slow = float(per_block_time_ms(LOW_PERFORMANCE, INPUT_TOKENS, OUTPUT_TOKENS))
    specs = []
    for index in range(servers):
        gpu, tau_p = (HIGH_PERFORMANCE, tau_p_fast) if index in fast else (LOW_PERFORMANCE, tau_p_slow)
        tau_c = float(rtt.rtt_ms[nodes[0], nodes[index + 1]]) + COMM_OVERHEAD_MS
        specs.append(ServerSpec(f"s{index + 1:02d}", gpu.memory_gb, tau_c, tau_p))
    swarm = SwarmModel(BLOOM_176B, tuple(specs))
    high = tuple(f"s{index + 1:02d}" for index in sorted(fast))
    return PaperInstance(swarm, high, rtt.source, int(nodes[0]))


DEFAULT_RATE_PER_MS = per_ms(DEFAULT_RATE_PER_S)
