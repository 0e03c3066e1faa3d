"""MELL live against its simulator: four replicas of SmolLM2-135M pack their sessions' KV on the emulated WAN
(`--kv-packing`), and the KV-packing simulator replays the same sessions; active servers over time and migrations,
side by side (issue 12's target: within 15%).

The swarm (spec `mell.md` 5.7, its simpler variant): four servers `r1`..`r4` each hosting all 30 blocks (the bins of
one segment), the DHT, a client and a monitor, each in a network namespace, every pair at 20 ms RTT and every access
link at 100 Mbit/s each way. Pages of 256 KiB (170 tokens of one block's KV), and `--token-pages` x 30 pages of KV per
server (C; default 10 x 30 = 300 pages: 1,700 tokens per session-block, so a bin holds a handful of sessions and the
size classes are L above 850 tokens, M 567-850, S 425-566, T 213-424, tiny below). The servers run `--kv-packing
POLICY --packing-epoch 1` (the leader of the four packs them every second).

Requests: the Azure 2023 conversation trace (`shared/data/azure_llm_inference_2023_conv.csv`) from `--offset`, its
prompt and output lengths divided by `--scale` (4, as the spec suggests: this CPU decodes a few tokens per second per
session, where the trace's outputs reach thousands) and cut to what one bin holds, its arrival times stretched to
`--rate` per second. The client replays them, one thread each (`table1_client.py`), without an orchestrator: each
session's route puts it on one accepting replica; the monitor polls every server's `info` twice a second.

The simulator (`orchestrator.sim.packing_sim`, the same packer) replays the sessions the live run served: each
arrives when its live session opened, on the replica its route put it on (`landed`; the packer's choice for it is a
move, as live), holds what it held live (30 blocks x ceil(tokens / 170) pages) and decodes at its own measured speed
(output tokens / its live lifetime), with C read from the servers, 1-s epochs, and moves timed at 100 Mbit/s and 20 ms
and the servers' measured prefill speed, within the leader's budgets (half an epoch of each). What the comparison
tests is the simulator's packing dynamics and move timing, not the client's routing, which it takes as given.

Printed: per policy, mean and peak active servers (holding any KV) and migrations, live and simulated, their ratio
and the verdict; active servers over time in 10-s windows; what else happened (failovers, errors, moves deferred).

    sudo .venv/bin/python benchmarks/mell_live.py [--policies mell] [--requests 120] [--rate 0.7] [--scale 4]

Needs root (network namespaces). Never asserts.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks.mell_live_monitor import spawn_monitor
from benchmarks.table1_client import run_replay, trace_requests
from netem import netns
from netem.network import EmulatedNetwork
from netem.topology import constant
from orchestrator.packing.segment_loop import PACKERS, packing_capacity
from orchestrator.sim.packing_sim import PackingSimConfig, PackingSimResult, SessionSpec, simulate
from swarm.local_swarm import SwarmProcesses, threads_per_server
from swarm.model import DEFAULT_MODEL, resolve_model

REPO = Path(__file__).resolve().parents[1]
TRACE = REPO.parent / "shared" / "data" / "azure_llm_inference_2023_conv.csv"
REPLICAS = ("r1", "r2", "r3", "r4")
HOSTS = ("dht", "client", "mon", *REPLICAS)
RTT_MS, MBIT = 20.0, 100.0
PAGE_BYTES = 256 << 10
EPOCH_S = 1.0
POLL_S = 0.5
WINDOW_S = 10.0
TARGET = 0.15  # simulated within 15% of live
MAX_TOKENS = 2048
BUSY_WAIT_S = 600.0  # a session that finds every replica full waits for room (at open and when it fails over)


def replica_memory(token_pages: int, page_bytes: int = PAGE_BYTES) -> int:
    """Gives a `--memory` that holds all 30 blocks and about `token_pages` pages of KV per block (the servers
    report the capacity they really have; that is what the simulator gets)."""
    from swarm.model.blocks import BlockRange

    source = resolve_model(DEFAULT_MODEL)
    probe = BlockRange(source, 0, 1)
    block_pages = -(-probe.block_bytes(0) // page_bytes) + 1  # +1: the pool aligns each tensor's start
    return (source.num_blocks * (block_pages + token_pages)) * page_bytes


@dataclass
class LiveRun:
    policy: str
    results: list[dict]  # the client's lines
    polls: list[dict]  # the monitor's lines
    t0_wall: float  # the wall-clock time of the replay's t = 0
    peers: dict[str, str]  # host -> peer id

    @property
    def served(self) -> list[dict]:
        return [r for r in self.results if "ended_s" in r]

    def first(self) -> dict:
        return self.polls[0]

    def end_s(self) -> float:
        return max(r["ended_s"] for r in self.served)

    def active_series(self) -> list[tuple[float, int]]:
        """Gives (t, servers holding KV) at every poll, t from the replay's start."""
        latest: dict[str, int] = {}
        series = []
        for row in sorted(self.polls, key=lambda r: r["t"]):
            latest[row["peer_id"]] = row["pages_kv"]
            series.append((row["t"] - self.t0_wall, sum(1 for pages in latest.values() if pages > 0)))
        return series

    def mean_active(self, until_s: float) -> float:
        """Gives the time-mean of servers holding KV over [0, until_s]."""
        series = [(t, n) for t, n in self.active_series() if 0 <= t <= until_s]
        total, previous = 0.0, None
        for t, active in series:
            if previous is not None:
                total += previous[1] * (t - previous[0])
            previous = (t, active)
        if previous is not None:
            total += previous[1] * (until_s - previous[0])
        start = series[0][0] if series else 0.0
        return total / (until_s - start) if until_s > start else 0.0

    def peak_active(self, until_s: float) -> int:
        return max((n for t, n in self.active_series() if 0 <= t <= until_s), default=0)

    def migrations(self) -> dict[str, int]:
        """Gives the sessions moved out by mode over the run (last poll less first, summed over servers)."""
        first: dict[str, dict] = {}
        last: dict[str, dict] = {}
        for row in sorted(self.polls, key=lambda r: r["t"]):
            first.setdefault(row["peer_id"], row)
            last[row["peer_id"]] = row
        moved = {"kv": 0, "replay": 0, "failed": 0}
        for peer, row in last.items():
            for mode in ("kv", "replay"):
                moved[mode] += row["migrations"]["out"][mode] - first[peer]["migrations"]["out"][mode]
            moved["failed"] += row["migrations"]["failed_out"] - first[peer]["migrations"]["failed_out"]
        return moved

    def packing(self) -> dict:
        """Gives the leader's packing statistics at the end (the server whose `packing` ran epochs)."""
        last: dict[str, dict] = {}
        for row in sorted(self.polls, key=lambda r: r["t"]):
            last[row["peer_id"]] = row
        stats = [row["packing"] for row in last.values() if row.get("packing")]
        return max(stats, key=lambda s: s["epochs"], default={})


def run_live(policy: str, args: argparse.Namespace, workdir: Path, memory: int) -> tuple[LiveRun, list[dict]]:
    workdir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with EmulatedNetwork(constant(HOSTS, RTT_MS, mbit=MBIT), run_id=f"ml{os.getpid()}{policy[:2]}") as network, \
            SwarmProcesses(workdir, announce_period_s=5.0, record_ttl_s=30.0,
                           torch_threads=threads_per_server(len(REPLICAS))) as swarm:
        swarm.start_dht(host=network.address("dht"), launcher=network.command("dht", []))
        procs = {host: swarm.start_server(
            DEFAULT_MODEL, "0:30", "--kv-packing", policy, "--packing-epoch", str(EPOCH_S), "--page-size",
            str(PAGE_BYTES), "--memory", str(memory), "--max-length", str(MAX_TOKENS), "--session-timeout", "900",
            wait=False, name=host, host=network.address(host), launcher=network.command(host, []),
        ) for host in REPLICAS}
        for proc in procs.values():
            swarm.wait_ready(proc)
        polls_path = workdir / "polls.jsonl"
        monitor = spawn_monitor(network, DEFAULT_MODEL, swarm.initial_peers, len(REPLICAS), polls_path, POLL_S, workdir)
        try:
            deadline = time.monotonic() + 60
            while len(_read_jsonl(polls_path)) < len(REPLICAS) and time.monotonic() < deadline:
                time.sleep(0.5)
            first = _read_jsonl(polls_path)[0]
            capacity = packing_capacity(first["capacity_pages"], first["blocks"])
            bin_tokens = capacity // first["blocks"] * first["kv_tokens_per_page"]
            requests = trace_requests(TRACE, args.requests, args.rate, offset=args.offset, prompt_scale=args.scale,
                                      output_scale=args.scale, max_tokens=min(MAX_TOKENS, bin_tokens))
            requests_path = workdir / "requests.json"
            requests_path.write_text(json.dumps(requests))
            print(f"  {policy}: swarm up in {time.monotonic() - started:.0f} s; KV pages {first['capacity_pages']}, "
                  f"C = {capacity} ({bin_tokens} tokens of 30 blocks); {len(requests)} requests over "
                  f"{requests[-1]['at_s']:.0f} s", flush=True)
            out = workdir / "results.jsonl"
            run_replay(network, swarm.initial_peers, DEFAULT_MODEL, requests_path, out, workdir, args.timeout,
                       "--orchestrator", "none", "--busy-wait", str(BUSY_WAIT_S))
            time.sleep(2 * POLL_S + EPOCH_S)  # the last departures reach the polls
        finally:
            monitor.send_line("quit")
            monitor.stop()
    results = _read_jsonl(out)
    offsets = [r["arrival_wall"] - r["arrival_s"] for r in results]
    peers = {host: proc.peer_id for host, proc in procs.items()}
    return LiveRun(policy, results, _read_jsonl(polls_path), statistics.median(offsets), peers), requests


def _read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def replay_in_sim(live: LiveRun, requests: list[dict]) -> PackingSimResult:
    """Runs the simulator on the sessions the live run served, with the live swarm's geometry and speeds."""
    first = live.first()
    rows = {row["peer_id"]: row for row in live.polls}
    prefill = statistics.median(row["prefill_ms_per_token"] for row in rows.values() if row["prefill_ms_per_token"])
    blocks = first["blocks"]
    capacity = packing_capacity(min(row["capacity_pages"] for row in rows.values()), blocks)  # the leader's C
    lengths = {request["id"]: request for request in requests}
    sessions = []
    for result in live.served:
        request = lengths[result["id"]]
        lifetime_s = max(1e-3, result["ended_s"] - result["started_s"])
        sessions.append(SessionSpec(
            f"{result['id']:04d}", result["started_s"], request["prompt_tokens"], request["output_tokens"],
            decode_tokens_per_s=request["output_tokens"] / lifetime_s, landed=result["first_route"][0],
        ))
    config = PackingSimConfig(
        capacity_pages=capacity, tokens_per_page=first["kv_tokens_per_page"],
        kv_bytes_per_token=first["kv_bytes_per_token"] * blocks, decode_tokens_per_s=1.0,
        bandwidth_bytes_per_s=MBIT * 1e6 / 8, rtt_ms=RTT_MS, prefill_ms_per_token=prefill * blocks, epoch_s=EPOCH_S,
        comm_budget_share=0.5, comp_budget_share=0.5, blocks=blocks, moves_wait_for_room=True,
    )
    return simulate(sessions, PACKERS[live.policy](sorted(rows), capacity), config)


def sim_mean_active(result: PackingSimResult, until_s: float) -> float:
    """Gives the simulated time-mean of bins holding KV over [0, until_s] (moves in flight counted)."""
    epochs = [record for record in result.epochs if record.t_s < until_s]
    if not epochs or until_s <= 0:
        return 0.0
    covered = sum(min(EPOCH_S, until_s - record.t_s) * record.active_bin_s / EPOCH_S for record in epochs)
    return covered / until_s


def ratio(sim: float, live: float) -> float:
    return sim / live if live else math.nan


def verdict(sim: float, live: float) -> str:
    return "PASS" if live and abs(sim / live - 1) <= TARGET else "FAIL"


def report(live: LiveRun, sim: PackingSimResult) -> None:
    served, summary = live.served, sim.summary
    until_s = max(live.end_s(), summary.duration_s)
    live_mean, sim_mean = live.mean_active(until_s), sim_mean_active(sim, until_s)
    live_peak, sim_peak = live.peak_active(until_s), summary.peak_active_bins
    moved = live.migrations()
    live_moves = moved["kv"] + moved["replay"]
    failovers = sum(r.get("failovers", 0) for r in served)
    errors = [r["error"] for r in live.results if "error" in r]
    print(f"\n## {live.policy}: live vs simulated, {len(served)} sessions served over {live.end_s():.0f} s "
          f"(both averaged over [0, {until_s:.0f}] s)\n")
    print("| measure | live | simulated | sim / live | verdict (within 15%) |")
    print("|---|---|---|---|---|")
    print(f"| mean active servers | {live_mean:.2f} | {sim_mean:.2f} | {ratio(sim_mean, live_mean):.2f} | "
          f"{verdict(sim_mean, live_mean)} |")
    print(f"| peak active servers | {live_peak} | {sim_peak} | {ratio(sim_peak, live_peak):.2f} | (report) |")
    print(f"| migrations | {live_moves} (KV {moved['kv']}, replay {moved['replay']}) | {summary.migrations} (KV "
          f"{summary.kv_migrations}, replay {summary.replay_migrations}) | {ratio(summary.migrations, live_moves):.2f}"
          f" | {verdict(summary.migrations, live_moves)} |")
    print(f"| mean move s (live: the source's part, a KV send or a replay's hand-over; simulated: the whole move) | "
          f"{_live_mean_move_s(live):.2f} | {summary.mean_migration_s:.2f} | | (report) |")
    packing = live.packing()
    print(f"\nlive: failovers {failovers}, errors {len(errors)}{' (' + errors[0][:120] + ')' if errors else ''}, "
          f"moves that failed {moved['failed']}; the leader: {packing.get('epochs', 0)} epochs, moves "
          f"{packing.get('moves', {})}")
    print(f"simulated: {summary.deferrals} deferrals, {summary.oversized_migrations} oversized, rejected "
          f"{summary.rejected}, evicted {summary.evicted}, peak packed bins {summary.peak_packed_bins}, "
          f"fluid bound {summary.peak_bins_lower_bound}")
    print(f"\nactive servers over time ({WINDOW_S:g}-s windows, time-mean):\n")
    print("| from s | live | simulated |")
    print("|---|---|---|")
    series = live.active_series()
    start = 0.0
    while start < until_s:
        end = min(until_s, start + WINDOW_S)
        points = [n for t, n in series if start <= t < end]
        live_window = statistics.mean(points) if points else math.nan
        sim_window = [r.active_bin_s / EPOCH_S for r in sim.epochs if start <= r.t_s < end]
        sim_value = statistics.mean(sim_window) if sim_window else 0.0
        print(f"| {start:.0f} | {live_window:.2f} | {sim_value:.2f} |")
        start = end


def _live_mean_move_s(live: LiveRun) -> float:
    last: dict[str, dict] = {}
    for row in sorted(live.polls, key=lambda r: r["t"]):
        last[row["peer_id"]] = row
    count = sum(row["migrations"]["out"]["kv"] + row["migrations"]["out"]["replay"] for row in last.values())
    return sum(row["migrations"]["ms_out"] for row in last.values()) / 1000 / count if count else math.nan


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policies", default="mell", help="comma-separated: mell, bf, wf, lb (one live run each)")
    parser.add_argument("--requests", type=int, default=120)
    parser.add_argument("--offset", type=int, default=0, help="the first request of the trace replayed")
    parser.add_argument("--rate", type=float, default=0.7, help="mean arrivals per second")
    parser.add_argument("--scale", type=float, default=4.0, help="the trace's lengths are divided by this")
    parser.add_argument("--token-pages", type=int, default=10, help="KV pages per block each server holds")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds one live replay may take")
    parser.add_argument("--keep", type=Path, help="a folder to keep the processes' logs and the runs' records in")
    args = parser.parse_args(argv)
    problem = netns.support_problem()
    if problem:
        print(f"cannot run: {problem}")
        return 2
    print(f"# chainswarm mell_live benchmark, {datetime.datetime.now().isoformat(timespec='seconds')}")
    print(f"machine: {platform.platform()}, cpu_count={os.cpu_count()}, python {platform.python_version()}; "
          f"4 replicas of blocks 0:30, {RTT_MS:g} ms RTT, {MBIT:g} Mbit/s; {args.requests} requests from "
          f"#{args.offset} at {args.rate}/s, lengths / {args.scale:g}; pages of {PAGE_BYTES >> 10} KiB", flush=True)
    memory = replica_memory(args.token_pages)
    with tempfile.TemporaryDirectory(prefix="mell-live-") as tmp:
        for policy in args.policies.split(","):
            live, requests = run_live(policy, args, (args.keep or Path(tmp)) / policy, memory)
            report(live, replay_in_sim(live, requests))
    return 0


if __name__ == "__main__":
    sys.exit(main())
