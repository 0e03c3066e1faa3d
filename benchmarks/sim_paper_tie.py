"""Whether any composition beats the one chain of all four fast servers in sim_paper's J=10, eta=0.4 cell.

In that cell the proposed method and Parallax-style build the same chain: the four 40 GB servers, 18/18/17/17
blocks, capacity 8. A chain with fewer hops needs three fast servers holding 23-24 blocks each, which leaves them
cache for 3 jobs; every other chain then needs slow servers for the blocks the fourth fast server cannot hold.
For each of the cell's 20 seeds this prints JFFC's exact mean response (Appendix A.3 steady state, exponential
service) of the four-server chain next to the best plan of that other kind: a 3-hop chain over any three fast
servers, alone or with an overflow chain of the fourth fast server and the lowest-RTT slow servers, capacity
1-4. Four-hop chains over the four fast servers all take the same time (equal tau_p, every tau_c once), and a
chain that puts any block on a slow server pays 66 ms per block more than one on a fast server.

    .venv/bin/python benchmarks/sim_paper_tie.py
"""

from __future__ import annotations

import itertools
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script

from orchestrator.analysis import exact_mean_response
from orchestrator.sim.presets import DEFAULT_RATE_PER_MS, paper_swarm
from orchestrator.swarm_model import ModelSpec, ServerSpec

SERVERS, ETA, SEEDS = 10, 0.4, 20
FOUR_HOP_BLOCKS = (18, 18, 17, 17)
THREE_HOP_BLOCKS = (24, 23, 23)


def capacity(server: ServerSpec, blocks: int, model: ModelSpec) -> int:
    """Gives how many jobs' cache fit next to `blocks` blocks on `server`."""
    return math.floor((server.memory_gb - model.block_gb * blocks) / (model.cache_gb * blocks) + 1e-9)


def three_hop_plans(fast: list[ServerSpec], slow: list[ServerSpec], model: ModelSpec) -> list[tuple[float, str]]:
    """Gives (exact mean response ms, description) of every 3-hop plan, with and without an overflow chain."""
    rate = DEFAULT_RATE_PER_MS
    plans = []
    slow = sorted(slow, key=lambda server: server.tau_c_ms)
    for trio in itertools.combinations(fast, 3):
        fourth = next(server for server in fast if server not in trio)
        chain_ms = sum(server.tau_c_ms for server in trio) + model.blocks * trio[0].tau_p_ms
        jobs = min(capacity(server, blocks, model) for server, blocks in zip(trio, THREE_HOP_BLOCKS, strict=True))
        plans.append((exact_mean_response(rate, [1 / chain_ms], [jobs]), f"3-hop chain, capacity {jobs}"))
        for overflow_jobs in range(1, 5):
            per_block_gb = model.block_gb + model.cache_gb * overflow_jobs
            fourth_blocks = min(model.blocks, math.floor(fourth.memory_gb / per_block_gb))
            slow_blocks = math.floor(slow[0].memory_gb / per_block_gb)
            hops = math.ceil((model.blocks - fourth_blocks) / slow_blocks)
            if hops > len(slow):
                continue
            overflow_ms = (
                fourth.job_time_ms(fourth_blocks) + sum(server.tau_c_ms for server in slow[:hops])
                + (model.blocks - fourth_blocks) * slow[0].tau_p_ms
            )
            mean_ms = exact_mean_response(rate, [1 / chain_ms, 1 / overflow_ms], [jobs, overflow_jobs])
            plans.append((mean_ms, f"3-hop chain, capacity {jobs} + overflow over {fourth.name} "
                                   f"({fourth_blocks} blocks) and {hops} slow servers, capacity {overflow_jobs}"))
    return plans


def main() -> None:
    print(f"J={SERVERS}, eta={ETA}, lambda={DEFAULT_RATE_PER_MS * 1000:.1f} jobs/s: exact JFFC mean response (s)")
    print("| seed | 4 fast servers, 1 chain | best 3-hop plan | margin ms | best 3-hop plan is |")
    print("|---|---|---|---|---|")
    margins = []
    for seed in range(SEEDS):
        instance = paper_swarm(SERVERS, ETA, seed)
        model = instance.swarm.model
        fast = [server for server in instance.swarm.servers if server.name in instance.high_performance]
        slow = [server for server in instance.swarm.servers if server.name not in instance.high_performance]
        jobs = min(capacity(server, blocks, model) for server, blocks in zip(fast, FOUR_HOP_BLOCKS, strict=True))
        chain_ms = sum(server.tau_c_ms for server in fast) + model.blocks * fast[0].tau_p_ms
        four_hop = exact_mean_response(DEFAULT_RATE_PER_MS, [1 / chain_ms], [jobs])
        best, label = min(three_hop_plans(fast, slow, model))
        margins.append(best - four_hop)
        print(f"| {seed} | {four_hop / 1000:.3f} (capacity {jobs}) | {best / 1000:.3f} | {best - four_hop:+.0f} "
              f"| {label} |")
    print(f"\nthe four-server chain is faster than every 3-hop plan in {sum(m > 0 for m in margins)} of {SEEDS} seeds; "
          f"smallest margin {min(margins):.0f} ms")


if __name__ == "__main__":
    main()
