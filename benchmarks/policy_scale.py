"""How fast the orchestrator's policies are at scale: GBP-CR + GCA + tuning c, and JFFC events per second.

Swarms of J = 100, 1,000 and 5,000 servers serve an 80-block model (BLOOM-176B's block and cache sizes:
1.32 GB and 0.11 GB); 20% are 40 GB servers at 109 ms per block, the rest 20 GB at 175 ms; tau_c = 18 ms plus
a seeded RTT drawn uniformly from 5..60 ms. The arrival rate scales with J: 0.01 J jobs/s is the paper's default
ratio (0.2 jobs/s for J = 20); a second row per J puts 5x that load on the swarm. Each row times one
`tune_capacity` call (GBP-CR + GCA for every candidate c, skipping unstable c, choosing by the Theorem 3.7 lower
bound) and, for the chosen c, one GBP-CR and one GCA call alone; "spare" rows do the same for the live-swarm variant
(spare chains: every server that fits a block hosts one, c chosen by the overflow estimate). JFFC is driven
through a million events over the chains of the J = 1,000 plan and over 10,000 synthetic chains: arrivals and
completions as a simulator would call them, as a random walk that reverts to full occupancy (arrivals win 55:45
below it and lose 45:55 above it), so both free chains and the central queue are exercised.

Targets: J = 1,000 composed and tuned in under 2 s (both variants); JFFC at least 200k events/s. Prints a table and
a verdict; never asserts.

    .venv/bin/python benchmarks/policy_scale.py [--sizes 100,1000,5000] [--events 1000000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from orchestrator.allocation import gca
from orchestrator.dispatch import JFFC
from orchestrator.placement import gbp_cr
from orchestrator.swarm_model import Chain, ModelSpec, ServerSpec, SwarmModel, per_ms
from orchestrator.tuning import tune_capacity

TARGET_J = 1000
TARGET_TUNE_S = 2.0
TARGET_EVENTS_PER_S = 200_000
BLOCKS = 80
RHO_BAR = 0.7


def scale_swarm(count: int, seed: int = 0) -> SwarmModel:
    """Gives the benchmark's swarm of `count` servers (seeded)."""
    rng = random.Random(seed)
    fast = set(rng.sample(range(count), max(1, count // 5)))
    servers = tuple(
        ServerSpec(f"s{index:05d}", 40.0 if index in fast else 20.0, 18.0 + rng.uniform(5.0, 60.0),
                   109.0 if index in fast else 175.0)
        for index in range(count)
    )
    return SwarmModel(ModelSpec(BLOCKS, 1.32, 0.11), servers)


def best_of(repeats: int, run) -> tuple[float, object]:
    """Gives the fastest wall time of `repeats` runs of `run()` and its last result."""
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = run()
        times.append(time.perf_counter() - start)
    return min(times), result


def time_composition(count: int, jobs_per_s: float, repeats: int, spare: bool = False) -> dict:
    swarm = scale_swarm(count)
    rate = per_ms(jobs_per_s)
    method = "overflow" if spare else "lower_bound"
    tune_s, plan = best_of(repeats, lambda: tune_capacity(swarm, rate, RHO_BAR, method=method, spare_chains=spare))
    placement_s, placement = best_of(repeats, lambda: gbp_cr(swarm, plan.c, rate, RHO_BAR, spare_chains=spare))
    allocation_s, chains = best_of(repeats, lambda: gca(swarm, placement))
    return {
        "variant": "spare" if spare else "paper",
        "servers": count, "jobs_per_s": jobs_per_s, "c": plan.c, "hosting": len(placement.hosting()),
        "chains": len(chains), "jobs_at_once": sum(chain.capacity for chain in chains),
        "lower_s": plan.lower_ms / 1000.0, "gbp_cr_ms": placement_s * 1000.0, "gca_ms": allocation_s * 1000.0,
        "tune_s": tune_s, "plan": plan,
    }


def jffc_events_per_s(chains: list[Chain], events: int, seed: int = 0) -> tuple[float, float]:
    """Gives (events/s, share of arrivals that queued) for a random walk of arrivals and completions."""
    jffc = JFFC(chains)
    total = sum(chain.capacity for chain in chains)
    rng = random.Random(seed)
    running: list[int] = []  # the chain of every job in service, as a simulator would track it
    next_job = 0
    for _ in range(total):  # start full (untimed), so the walk crosses full occupancy both ways
        running.append(jffc.arrive(next_job))
        next_job += 1
    coins = [rng.random() for _ in range(events)]
    picks = [rng.random() for _ in range(events)]
    queued = arrivals = 0
    arrive, complete = jffc.arrive, jffc.complete
    start = time.perf_counter()
    waiting = 0
    for coin, pick in zip(coins, picks, strict=True):
        # arrivals outpace completions below full occupancy and lag above it, so the walk keeps crossing it
        if coin < (0.45 if waiting else 0.55) or not running:
            arrivals += 1
            chain = arrive(next_job)
            next_job += 1
            if chain is None:
                queued += 1
                waiting += 1
            else:
                running.append(chain)
        else:
            slot = int(pick * len(running))
            chain = running[slot]
            if complete(chain) is None:  # nobody waiting: the slot empties
                running[slot] = running[-1]
                running.pop()
            else:
                waiting -= 1
    elapsed = time.perf_counter() - start
    return events / elapsed, queued / max(arrivals, 1)


def synthetic_chains(count: int, seed: int = 1) -> list[Chain]:
    rng = random.Random(seed)
    return [Chain(("s",), (BLOCKS,), rng.randint(1, 20), rng.uniform(8000.0, 20000.0)) for _ in range(count)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100,1000,5000", help="numbers of servers J, comma-separated")
    parser.add_argument("--events", type=int, default=1_000_000, help="JFFC events per measurement")
    parser.add_argument("--repeats", type=int, default=3, help="runs per timing (the fastest counts)")
    args = parser.parse_args()
    sizes = [int(part) for part in args.sizes.split(",")]
    print(f"# chainswarm policy_scale benchmark, {datetime.datetime.now().isoformat(timespec='seconds')}")
    print(f"machine: {platform.platform()}, cpu_count={os.cpu_count()}, python {platform.python_version()}; "
          f"loadavg {', '.join(f'{value:.2f}' for value in os.getloadavg())}")
    print(f"model: L={BLOCKS}, s_m=1.32 GB, s_c=0.11 GB; rho_bar={RHO_BAR}; fastest of {args.repeats} runs\n")
    header = ("| variant | J | jobs/s | c | hosting | chains | jobs at once | lower bound s | GBP-CR ms | GCA ms "
              "| tune + compose s |")
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    rows = []
    for count in sizes:
        for load, spare in ((0.01, False), (0.01, True), (0.05, False), (0.05, True)):
            row = time_composition(count, load * count, args.repeats if count <= TARGET_J else 1, spare)
            rows.append(row)
            print(f"| {row['variant']} | {count} | {row['jobs_per_s']:g} | {row['c']} | {row['hosting']} | "
                  f"{row['chains']} | "
                  f"{row['jobs_at_once']} | {row['lower_s']:.2f} | {row['gbp_cr_ms']:.1f} | {row['gca_ms']:.1f} | "
                  f"{row['tune_s']:.3f} |")
    print("\n| JFFC over | chains | events | events/s | arrivals queued |")
    print("|---|---|---|---|---|")
    dispatch_rates = []
    plan_chains = next((list(row["plan"].chains) for row in reversed(rows)
                        if row["servers"] == TARGET_J and row["variant"] == "paper"), None)
    cases = [("J=1000 plan (5x load)", plan_chains)] if plan_chains else []
    cases.append(("synthetic", synthetic_chains(10_000)))
    for label, chains in cases:
        runs = [jffc_events_per_s(chains, args.events, seed) for seed in range(args.repeats)]
        rate = max(run[0] for run in runs)
        dispatch_rates.append(rate)
        print(f"| {label} | {len(chains)} | {args.events} | {rate:,.0f} | "
              f"{100 * statistics.mean(run[1] for run in runs):.1f}% |")
    target_rows = [row for row in rows if row["servers"] == TARGET_J]
    worst_tune = max((row["tune_s"] for row in target_rows), default=float("nan"))
    slowest_dispatch = min(dispatch_rates)
    ok = worst_tune < TARGET_TUNE_S and slowest_dispatch >= TARGET_EVENTS_PER_S
    verdict = "PASS" if ok else ("FAIL" if target_rows else f"INCOMPLETE (no J={TARGET_J} row)")
    print(f"\nverdict: {verdict}: J={TARGET_J} tune + compose {worst_tune:.3f} s "
          f"(target < {TARGET_TUNE_S:g} s); JFFC {slowest_dispatch:,.0f} events/s (target >= {TARGET_EVENTS_PER_S:,})")


if __name__ == "__main__":
    main()
