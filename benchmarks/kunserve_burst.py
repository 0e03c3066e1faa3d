"""KunServe live on the emulated WAN (spec `kunserve.md` 5.8): two replicas of SmolLM2-135M whose pools throttle on
KV before their cores do, under the burst of the Azure code trace, in four arms on the same arrivals, and the
simulator (`orchestrator.sim.kunserve_sim`) replaying the same requests on the live swarm's measured geometry.

The swarm: servers `a` and `b`, the DHT, a client and a monitor, each in a network namespace, every pair at `--rtt`
ms (20, and 40) and every access link at 100 Mbit/s each way. Pools of 30 x `--kv-pages-per-block` 1-MiB pages beside
the 30 blocks' parameters (and one alignment page per block): sessions of at most 288 tokens take one page per block,
so a replica holds that many sessions and one more, and a drop to half the blocks frees 15 blocks' parameters (210
pages) for KV.
Arms:
1. no drop (Llumnix (replication) analog): both host 0:30; a client that finds both full backs off (0.5 s doubling
   to 4 s, `ClientConfig.busy_wait_s`) and asks again;
2. static pipeline (Llumnix (pipeline)): `a` hosts 0:15 and `b` 15:30 all the time;
3. KunServe, blocking exchange: both host 0:30 with `--kv-dropping --kv-exchange blocking`;
4. KunServe with remote attention (live exchange): as 3 with `--kv-exchange live`: a victim goes on at once through
   the keeper, which has the victim's server attend over the lent KV until it has followed (`server.remote_attention`).
Requests: every `--thin`-th request of the code trace from `--start` to `--end` s (its busiest 10 s, 12.7x its mean
rate, are 858-868 s), prompts divided by `--prompt-scale` and cut to 256 tokens, outputs cut to 32, arrivals
stretched to a mean of `--rate` per second (the burst's shape kept). Each request's greedy tokens are compared with
the no-drop arm's for the same request (the same random prompt).
Without `--rate` and `--kv-pages-per-block`, both are sized to the machine, so that KV throttles before the cores do
whatever their speed. A calibration run loads the no-drop swarm with 12 of the requests, one every 0.5 s, and takes
what a prompt token and a decode step cost a loaded server (its batch counters) and a session's median TTFT and TBT.
The rate is the one at which the requests arriving in the busiest 10 s ask the two servers for exactly their 10 s of
compute; the pools, the largest at which the busiest moment (every request open from its arrival for its calibrated
time) asks three times the sessions the two servers hold undropped. Each RTT, and each turn of `--repeats`, is sized by
its own calibration run at that RTT just before its arms, since this VM's speed moves between turns; the arms of one
turn replay the same arrivals on the same pools.

Printed per RTT: per arm, P50/P99 TTFT (arrival to first token, backoff waits included), P50/P99 TBT (a request's
mean time per token after its first), the victims' longest and mean stall (the servers' `exchange` statistics),
drops and restores, requests whose tokens differ from the no-drop arm's, errors; the ratios to arm 1 (targets: P99
TTFT >= 3x lower, TBT P50 within 2x); KV pages held and capacity over time in 5-s windows; the simulator's P99 TTFT
of every arm on the live run's geometry and speeds, against the live one (target: within 15%). A P99 of 79 requests
is about their longest wait, and where clients back off who waits longest turns on milliseconds: `--repeats N` runs
the arms N turns, each sized anew (a row per run, each turn's targets against its own no-drop run) and
holds the simulator against each run, fitted on its turn's no-drop run (the machine's speed moves between turns) and,
for a server that hosts a slice, on its turn's static pipeline, and the median of each arm's simulated P99s against
that of its live ones. `--report-only --workdir DIR [DIR ...]` reports kept runs again; with several, also each
arm's TTFT quantiles over all their requests against the simulator's over all their replays (`report_pooled`): a P99
that stands on tens of long waits, not on one.

    sudo .venv/bin/python benchmarks/kunserve_burst.py [--rtt 20 40] [--rate 0.6] [--thin 6] [--repeats 3]
    .venv/bin/python benchmarks/kunserve_burst.py --report-only --rtt 40 --workdir DIR [DIR ...]

Needs root (network namespaces). Never asserts.
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import datetime
import functools
import itertools
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks.client_work import ClientWork, Round
from benchmarks.client_work import measure as measure_client_work
from benchmarks.corun import Corun, measure_corun
from benchmarks.link_crossing import LinkCrossing
from benchmarks.link_crossing import measure as measure_link_crossing
from benchmarks.machine_cpu import CpuSampler, UntrackedCpu, fit_untracked, read_samples
from benchmarks.mell_live import replica_memory
from benchmarks.mell_live_monitor import spawn_monitor
from benchmarks.refused_tries import RefusedTries
from benchmarks.refused_tries import measure as measure_refused_tries
from benchmarks.table1_client import run_replay
from client.batched_head import MAX_GANG_WAIT_S
from client.swarm_client import ClientConfig
from netem.network import EmulatedNetwork
from netem.topology import constant
from orchestrator.admission import BUSY_BACKOFF_FIRST_S, BUSY_BACKOFF_MAX_S, NAMED_ROOM_GRACE_S, NAMED_ROOM_LEAD_S
from orchestrator.sim.kunserve_sim import KunServeSimConfig, KunServeSimResult, SimRequest, simulate
from orchestrator.sim.workload import Trace, load_azure_trace
from server.scheduler import DEFAULT_MAX_BATCH_TOKENS
from server.sessions import REFUSED_WINDOW_S
from swarm.local_swarm import SwarmProcesses
from swarm.model import DEFAULT_MODEL, resolve_model

REPO = Path(__file__).resolve().parents[1]
TRACE = REPO.parent / "shared" / "data" / "azure_llm_inference_2023_code.csv"
SERVERS = ("a", "b")
HOSTS = ("dht", "client", "mon", *SERVERS)
MBIT = 100.0
WIRE_BYTES = 4  # a hidden state's element on the wire: float32, the client's default (no --compression)
PAGE_BYTES = 1 << 20
MAX_PROMPT, MAX_OUTPUT = 256, 32
HEADROOM_TOKENS = MAX_OUTPUT  # admission reserves a session's output: KV throttles on what sessions will take
POLL_S = 0.5
CPU_FILE = "cpu.jsonl"  # in an arm's workdir: its processes' CPU, sampled (`benchmarks.machine_cpu`)
BATCH_TRACE_SUFFIX = "-batches.jsonl"  # in an arm's workdir, after a server's name: its batches (`server.batch_trace`)
BATCH_NOISE_MIN_BATCHES = 30  # a server's trace with fewer batches says nothing of their spread (`batch_noise`)
BATCH_NOISE_FLOOR_MS = 1.0  # a fit below this (a batch of nothing) is taken as this
# `batch_noise` of runs kept without batch traces (before r89): what r89's no-drop servers' traces gave
BATCH_NOISE_UNTRACED = 0.25
WINDOW_S = 5.0
BUSY_WAIT_S = 600.0
ARMS = ("no drop", "static pipeline", "KunServe blocking", "KunServe remote attention")
TARGET_TTFT_GAIN, TARGET_TBT_RATIO, TARGET_SIM = 3.0, 2.0, 0.15
COMPUTE_SHARE, BUSIEST_S = 1.0, 10.0  # the busiest 10 s of arrivals ask all of the servers' compute
CALIBRATION_REQUESTS, CALIBRATION_GAP_S, CALIBRATION_KV_PAGES = 12, 0.5, 4
KV_OVERLOAD = 3.0  # the busiest moment's sessions over what the two servers' pools hold undropped [r18: at 2x,
# calibration noise sized 2 pages per block in 4 of 6 turns, a burst that barely throttled (no-drop P99 7.8-9.4 s)]


@functools.cache
def _trace() -> Trace:
    return load_azure_trace(TRACE)


def burst_requests(args: argparse.Namespace, rate: float) -> list[dict]:
    """Gives the replayed requests: every `thin`-th of the trace in [start, end), arrivals stretched to `rate`."""
    trace = _trace()
    chosen = np.where((trace.seconds >= args.start) & (trace.seconds < args.end))[0][:: args.thin]
    seconds = trace.seconds[chosen] - trace.seconds[chosen[0]]
    stretch = (len(chosen) - 1) / float(seconds[-1]) / rate
    return [{"id": n, "at_s": float(seconds[n] * stretch),
             "prompt_tokens": max(1, min(MAX_PROMPT, round(trace.context_tokens[i] / args.prompt_scale))),
             "output_tokens": max(2, min(MAX_OUTPUT, int(trace.generated_tokens[i])))}
            for n, i in enumerate(chosen)]


@dataclass(frozen=True)
class StateCompute:
    """What the servers computed while they hosted a given number of blocks (`ArmRun.compute_by_blocks`)."""

    prompt_us_per_token_block: float  # the batches holding prompt tokens, per token and block
    other_ms_per_batch_block: float  # the other batches (decode steps), per batch and block
    sessions: float  # open sessions per server, mean over the polls that saw a batch
    prompt_tokens: int
    prompt_cpu_us_per_token_block: float = math.nan  # the same batches' CPU time (servers that counted it)


@dataclass(frozen=True)
class BatchCpu:
    """What the servers' computing threads spent on a run's batches (`ArmRun.batch_cpu`)."""

    prompt_us_per_token_block: float  # the CPU of prompt tokens' batches per token and block: the machine's speed
    wall_over_cpu: float  # the batches' wall time over their CPU time: how much the machine's other work slowed them
    prompt_wall_over_cpu: float  # the same over the batches that held prompt tokens


@dataclass
class ArmRun:
    arm: str
    results: list[dict]
    polls: list[dict]
    t0_wall: float
    workdir: Path | None = None  # where its files are kept
    requests: dict[int, dict] = dataclasses.field(default_factory=dict)  # what it replayed, by id
    # what the simulator fitted on this no-drop run (`other_work_weight`, `crowd_delay_ms`), by name and the
    # round trip it started from
    fits: dict[tuple[str, float], float] = dataclasses.field(default_factory=dict, repr=False, compare=False)

    @property
    def served(self) -> list[dict]:
        return [r for r in self.results if "first_token_s" in r and "ended_s" in r]

    def ttft(self) -> np.ndarray:
        return np.array([r["first_token_s"] - r["arrival_s"] for r in self.served])

    def tbt(self) -> np.ndarray:
        return np.array([(r["ended_s"] - r["first_token_s"]) / (self.requests[r["id"]]["output_tokens"] - 1)
                         for r in self.served])

    def decode_s(self) -> float:
        """Gives how long its requests decoded, summed: from each one's first token to its last."""
        return sum(r["ended_s"] - r["first_token_s"] for r in self.served)

    def untracked_cpu(self) -> UntrackedCpu | None:
        """Gives what its processes outside the simulator's spent per token (through one whole server, and through a
        group's members: while a server hosted fewer blocks than the model's, `piped_since`) and per refused round
        (the sampler's `CPU_FILE`, `benchmarks.machine_cpu`); None for runs recorded without it."""
        samples = read_samples(self.workdir / CPU_FILE) if self.workdir is not None else []
        tokens = [self.t0_wall + at for r in self.served
                  for at in np.linspace(r["first_token_s"], r["ended_s"], max(1, len(r.get("tokens", ()))))]
        since = self.piped_since()
        starts = [t for t, _ in since]
        through_group = [(at := bisect.bisect_right(starts, t) - 1) >= 0 and since[at][1] for t in tokens]
        rounds = [self.t0_wall + started for r in self.results for kind, started, *_ in r.get("open_attempts", ())
                  if kind == "backoff"]
        return fit_untracked(samples, [t for t, group in zip(tokens, through_group, strict=True) if not group], rounds,
                             [t for t, group in zip(tokens, through_group, strict=True) if group])

    def piped_since(self) -> list[tuple[float, bool]]:
        """Gives, in wall-time order, from when on a token crossed a group's members (True: some server hosted fewer
        blocks than the model's, by its last poll) or one whole server (False)."""
        if not self.polls:
            return []
        model = max(row["block_end"] for row in self.polls) - min(row["block_start"] for row in self.polls)
        latest: dict[str, bool] = {}
        states = []
        for row in sorted(self.polls, key=lambda row: row["t"]):
            latest[row["peer_id"]] = row["block_end"] - row["block_start"] < model
            states.append((row["t"], any(latest.values())))
        return states

    def last_polls(self) -> dict[str, dict]:
        last: dict[str, dict] = {}
        for row in sorted(self.polls, key=lambda row: row["t"]):
            last[row["peer_id"]] = row
        return last

    def exchange(self) -> tuple[float, float, int, int]:
        """Gives the victims' longest and mean stall (s), drops and restores, summed over the servers."""
        stalls_max, stalls_mean, drops, restores = 0.0, [], 0, 0
        for row in self.last_polls().values():
            dropping = row.get("dropping") or {}
            exchange = dropping.get("exchange") or {}
            stalls_max = max(stalls_max, exchange.get("stall_ms_max", 0.0) / 1000)
            if exchange.get("moved"):
                stalls_mean.append(exchange["stall_ms_mean"] / 1000)
            drops += dropping.get("drops", 0)
            restores += dropping.get("restores", 0)
        return stalls_max, (statistics.mean(stalls_mean) if stalls_mean else 0.0), drops, restores

    def live(self) -> dict[str, float]:
        """Gives the remote-attention statistics summed over the servers (the attend mean: weighted by attends)."""
        total: dict[str, float] = {}
        for row in self.last_polls().values():
            stats = (row.get("dropping") or {}).get("live") or {}
            for name, value in stats.items():
                total[name] = total.get(name, 0.0) + (value * stats["attends_sent"] if name == "attend_ms_mean"
                                                      else value)
        names = ("lent_sessions", "attends_sent", "switched_blocks", "copied_bytes", "lost")
        summed = {name: int(total.get(name, 0)) for name in names}
        return {**summed, "attend_ms_mean": total.get("attend_ms_mean", 0.0) / max(1, summed["attends_sent"])}

    def polls_by_peer(self, *, counted: bool = False) -> list[list[dict]]:
        """Gives each server's polls in time order; with `counted`, only those that carry batch counters."""
        by_peer: dict[str, list[dict]] = {}
        for row in sorted(self.polls, key=lambda row: row["t"]):
            if not counted or "batches" in row:
                by_peer.setdefault(row["peer_id"], []).append(row)
        return list(by_peer.values())

    def decode_steps(self) -> dict[str, tuple[int, float]]:
        """Gives the servers' decode steps by how they computed (`info` `decode_step_ms`: alone, beside a prompt's
        chunk, passing one), summed over the servers: how many, and their mean latency in ms."""
        last = [rows[-1]["decode_step_ms"] for rows in self.polls_by_peer() if "decode_step_ms" in rows[-1]]
        steps = {}
        for kind in ("alone", "beside_prefill", "passing_prefill"):
            count = sum(server.get(kind, {}).get("count", 0) for server in last)
            total = sum(server.get(kind, {}).get("count", 0) * server.get(kind, {}).get("mean_ms", 0.0)
                        for server in last)
            steps[kind] = (count, total / count if count else math.nan)
        return steps

    def compute_by_blocks(self) -> dict[int, StateCompute]:
        """Gives what the servers computed between two polls that found the same hosted range, by the blocks they
        hosted (30: whole, fewer: a member of a pipeline or of a dropped group), summed over the servers: the
        batches' compute per block, over their prompt tokens and their other batches, and the open sessions."""
        return {blocks: StateCompute(
                    1000 * grown["prompt_ms"] / grown["prompt_tokens"] if grown["prompt_tokens"] else math.nan,
                    grown["other_ms"] / grown["other_batches"] if grown["other_batches"] else math.nan,
                    grown["sessions"] / grown["busy"] if grown["busy"] else math.nan, int(grown["prompt_tokens"]),
                    1000 * grown["prompt_cpu_ms"] / grown["prompt_tokens"] if grown["prompt_tokens"] else math.nan)
                for blocks, grown in sorted(self._grown_by_blocks().items(), reverse=True)}

    def batch_cpu(self) -> BatchCpu | None:
        """Gives what the servers' computing threads spent on their batches (`info` batches `cpu_ms`), summed over the
        servers and the ranges they hosted (`_grown_by_blocks`); None for runs recorded before the servers counted
        it, or whose servers computed no prompt token."""
        states = self._grown_by_blocks().values()
        cpu, wall, prompt_cpu, prompt_wall, tokens = (
            sum(grown[name] for grown in states)
            for name in ("cpu_ms", "compute_ms", "prompt_cpu_ms", "prompt_ms", "prompt_tokens"))
        if not math.isfinite(cpu) or cpu <= 0 or tokens <= 0 or not prompt_cpu > 0:
            return None
        return BatchCpu(1000 * prompt_cpu / tokens, wall / cpu, prompt_wall / prompt_cpu)

    def _grown_by_blocks(self) -> dict[int, dict[str, float]]:
        """Gives, by the blocks the servers hosted, their batch counters' growth between two polls that found the
        same hosted range, summed over the servers: the compute and CPU time of all batches, those of the batches
        that held prompt tokens per block (`prompt_ms`, `prompt_cpu_ms`), the prompt tokens, the other batches'
        compute per block and their count, and the open sessions summed over the intervals that saw a batch
        (`busy`). CPU time is NaN where the servers did not count it."""
        grown: dict[int, dict[str, float]] = {}
        for rows in self.polls_by_peer(counted=True):
            for before, after in itertools.pairwise(rows):
                blocks = after["block_end"] - after["block_start"]
                if blocks != before["block_end"] - before["block_start"] or blocks == 0:
                    continue
                delta = {name: after["batches"][name] - before["batches"].get(name, 0) for name in after["batches"]}
                counted = "cpu_ms" in before["batches"]
                sums = grown.setdefault(blocks, dict.fromkeys(
                    ("compute_ms", "cpu_ms", "prompt_ms", "prompt_cpu_ms", "prompt_tokens", "other_ms",
                     "other_batches", "sessions", "busy"), 0.0))
                sums["compute_ms"] += delta["compute_ms"]
                sums["cpu_ms"] += delta["cpu_ms"] if counted else math.nan
                sums["prompt_ms"] += delta["prefill_batch_ms"] / blocks
                sums["prompt_cpu_ms"] += delta["prefill_batch_cpu_ms"] / blocks if counted else math.nan
                sums["prompt_tokens"] += delta["prefill_tokens"]
                sums["other_ms"] += (delta["compute_ms"] - delta["prefill_batch_ms"]) / blocks
                sums["other_batches"] += delta["batches"] - delta["prefill_batches"]
                sums["sessions"] += after["sessions"] if delta["batches"] else 0
                sums["busy"] += 1 if delta["batches"] else 0
        return grown

    def pages_series(self) -> list[tuple[float, int, int]]:
        """Gives (t, KV pages held, pages that can hold KV) over both servers at every poll."""
        latest: dict[str, dict] = {}
        series = []
        for row in sorted(self.polls, key=lambda row: row["t"]):
            latest[row["peer_id"]] = row
            series.append((row["t"] - self.t0_wall, sum(r["pages_kv"] for r in latest.values()),
                           sum(r["pages_total"] - r["pages_params"] for r in latest.values())))
        return series


def server_flags(arm: str, host: str, kv_pages_per_block: int) -> tuple[str, list[str]]:
    common = ["--page-size", str(PAGE_BYTES), "--memory", str(replica_memory(kv_pages_per_block, PAGE_BYTES)),
              "--max-length",
              str(MAX_PROMPT + MAX_OUTPUT), "--kv-headroom-tokens", str(HEADROOM_TOKENS), "--session-timeout", "900"]
    if arm == "static pipeline":
        return ("0:15" if host == "a" else "15:30"), common
    if arm == "KunServe blocking":
        return "0:30", [*common, "--kv-dropping", "--kv-exchange", "blocking"]
    if arm == "KunServe remote attention":
        return "0:30", [*common, "--kv-dropping", "--kv-exchange", "live"]
    return "0:30", common


def run_arm(arm: str, rtt_ms: float, requests: list[dict], kv_pages_per_block: int, args: argparse.Namespace,
            workdir: Path, label: str | None = None) -> ArmRun:
    workdir.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with EmulatedNetwork(constant(HOSTS, rtt_ms, mbit=MBIT), run_id=f"kb{os.getpid()}{ARMS.index(arm)}") as network, \
            SwarmProcesses(workdir, announce_period_s=5.0, record_ttl_s=30.0, torch_threads=1) as swarm:
        swarm.start_dht(host=network.address("dht"), launcher=network.command("dht", []))
        procs = {}
        for host in SERVERS:
            blocks, flags = server_flags(arm, host, kv_pages_per_block)
            flags = [*flags, "--batch-trace", str(workdir / f"{host}{BATCH_TRACE_SUFFIX}")]
            procs[host] = swarm.start_server(DEFAULT_MODEL, blocks, *flags, wait=False, name=host,
                                             host=network.address(host), launcher=network.command(host, []))
        for proc in procs.values():
            swarm.wait_ready(proc)
        polls_path = workdir / "polls.jsonl"
        monitor = spawn_monitor(network, DEFAULT_MODEL, swarm.initial_peers, len(SERVERS), polls_path, POLL_S, workdir)
        try:
            requests_path = workdir / "requests.json"
            requests_path.write_text(json.dumps(requests))
            print(f"  {label or arm} at {rtt_ms:g} ms: swarm up in {time.monotonic() - started:.0f} s", flush=True)
            with CpuSampler(workdir / CPU_FILE):
                run_replay(network, swarm.initial_peers, DEFAULT_MODEL, requests_path, workdir / "results.jsonl",
                           workdir, args.timeout, "--orchestrator", "none", "--busy-wait", str(BUSY_WAIT_S))
            time.sleep(2 * POLL_S)
        finally:
            monitor.send_line("quit")
            monitor.stop()
    return load_arm(arm, workdir)


def load_arm(arm: str, workdir: Path) -> ArmRun:
    """Gives the run of `arm` whose client results and monitor polls are in `workdir`."""
    results = _read_jsonl(workdir / "results.jsonl")
    offsets = [r["arrival_wall"] - r["arrival_s"] for r in results]
    kept = workdir / "requests.json"
    requests = {r["id"]: r for r in json.loads(kept.read_text())} if kept.is_file() else {}
    return ArmRun(arm, results, _read_jsonl(workdir / "polls.jsonl"), statistics.median(offsets) if offsets else 0.0,
                  workdir, requests)


def _read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def sim_config(base: ArmRun, rtt_ms: float, dropping: bool,
               exchanged: Sequence[ArmRun] = ()) -> KunServeSimConfig:
    """Gives the simulator the live swarm's geometry (from the servers' records) and speeds measured in the no-drop arm
    (`base`). What occupies a server: a decode iteration's fixed compute and its decoding requests' rows along the
    records' start-up timings of a decode step by batch size (`decode_rows_ms`: the fixed part is a lone step less its
    row at the slope from one row to the next timing; from stop 68's report, where one slope from 1 to 32 rows priced
    a pipeline member's 5-row decode batches 30% below their CPU time), so that a batch of one costs the records' lone
    decode step through all blocks (before r31's report the fixed part was the whole lone step, which priced a lone
    step a row too high), all scaled by what lone steps took the loaded servers against their start-up timing
    (`loaded_block_ms`); a row beside prompt tokens, the slope from one row to the widest timing; a prompt token,
    what the servers' counters measured beyond that fixed step (`prefill_token_ms_under_load`); prompts in chunks of the
    servers' `--max-batch-tokens`, a chunk leaving a token of them for every other session of its server, as their
    scheduler does (`reserve_decode_rows`). What occupies the client: its CPU per head pass and per token, on this
    machine (`client_work`): the tokens of one iteration share a pass, as the client's sessions on one chain share a
    head pass, a pass waits for the chain's steps on their way (`MAX_GANG_WAIT_S`), and passes follow each other, as one
    Python process serves every request. Decode steps pass a prompt chunk's batch (`overtake_prefill`), as the CPU
    servers' schedulers have them (runs before r79: join it, `join_prefill`). What only delays a token: the rest of
    the 10th percentile of the requests' TBT (the least loaded) beyond the compute and a lone token's client work, at
    least the network's round trip (the emulated links, the p2pd daemons and the RPC layers on either side). A group's
    extra member adds a half round trip (the pushed hop), which the simulator counts in a micro-batch's time. A
    client's try before it is admitted or backs off, as the
    no-drop arm's clients took it (`client_tries_of`): a DHT lookup unless a try looked one up within the client's
    `records_max_age_s`, then an `open` call on each server of its chain (the reports up to r38's gave every try the
    median round, lookup and opens, 0.2 s: the simulated prompts of a pipeline reached their first member up to 0.15 s
    after the live ones, which then shared its batches with the prompt before them). What the machine's other processes
    spend (the p2pd daemons, the delay fabric, the DHT nodes: `benchmarks.machine_cpu`), per token and per refused
    round, fitted on the CPU sampled in the no-drop arm (`ArmRun.untracked_cpu`), counts against the shared cores; runs
    recorded without the sampler: a refused round's cost measured on loopback (`refused_try_cpu_ms`), and nothing per
    token. Where a session goes: as the live clients route without an orchestrator, by latency over records that do not
    show load and over equal links, to either whole replica with room at random (`placement` "latency", seeded by the
    replay): of the live arrivals that found one replica busier than the other, half went to each (r50-r58), where
    the oldest replica first (`fewest_hops`, before r57's report) packed the quiet requests onto one, their decode
    steps into its prompts' batches. The servers and the client
    share this machine's cores (`cores`: the report runs where the arms ran), so work that starts while more of them
    compute than there are cores runs slower, and once every core computes, as much slower again as
    `benchmarks/corun.py` measured this machine's work to take (`corun_stretch`, kept with the run; from stop 68's
    report: the no-drop arm's fitted weight of the other work carried none of it into the arms that pipeline). A
    group's members batch on their own, as the live servers do
    (`member_batching`). A prompt's hidden states (float32, as the client sends them) cross the client's emulated link,
    up to the first member and, through a group, down and up again between members, one prompt after another, each
    message with what one of its size took beyond its bytes on this run's links (`link_crossing_extra`; none for runs
    kept without that reading). How fast victims' KV crosses between members: what the servers of the runs that dropped
    (`exchanged`) measured of their KV moves (`exchange_bytes_per_s`), else the link's rate; until a victim's KV has
    crossed, it takes pages on both members, as the live servers hold them back from new sessions
    (`exchange_transient`). Each batch's work varies as the no-drop servers' batches' CPU time varied beyond their
    tokens and rows (`batch_noise`, from their batch traces; runs kept without them: `BATCH_NOISE_UNTRACED`), drawn anew
    in each replay [from stop 69's report: without it the simulated burst's prompts waited about alike, and the live P99
    prompt, the unluckiest, came above]. Runs whose servers counted their batches' CPU time (`ArmRun.batch_cpu`, from
    r33 on): a prompt token at its CPU time rather than its wall time under load (which carries the no-drop crowd's
    contention, 1.2-1.4x, into every arm), the contention left to the simulator's sharing, whose weight of the machine's
    other work (`other_work_weight`) is fitted so the simulated no-drop servers' batches stretch as the live ones' did.
    The lone decode step stays at its wall time: lone steps run mostly while the machine is quiet. With the weight
    fitted, a token's delay outside the simulated work keeps the least loaded requests' figure and grows with each other
    request decoding at once, up to `round_trip_crowd_cap` of them (`crowd_delay_ms`): the growth is fitted on all of
    the no-drop requests, so that they decode, summed from first token to last, as long as the live ones did [before
    r57's report one constant was fitted so: it priced a lone request's token at up to twice its live time (r57: 156
    ms against 82), and the simulated drops came 1-4 s before the live ones (r57, r58), before the prompts the live
    drops caught on a whole replica]. With
    the least loaded requests' figure the live no-drop requests decoded 11-22% longer than the simulated ones (r33-r34),
    held their pages longer, and the live crowd drained later: the simulated P99 TTFT came out 17-31% low. The live
    requests' steps show where the time goes: the client's head and its loop between steps took 31 ms a step against the
    simulated 25 (r33), and the simulated servers' decode batches stretched less than their prompt batches (taken at
    their start), where live both stretched alike. The weight need not be fitted again after it: the simulated stretch
    stays within 3% of the live one (r33-r36). A victim's prompt that a drop caught starts over on the group after its
    client followed the new chain (`chain_follow_ms`), as the servers stop it [before r60's report it kept what its
    replica had computed and went on at once: r57's remote-attention P99 request, caught so, took 3.56 s live against
    1.84 s simulated]."""
    first = min(base.polls, key=lambda row: row["t"])
    decode = {timing["batch"]: timing["ms"] for timing in first["block_decode_ms"]}
    widest = max(decode, default=1)
    blocks = first["block_end"] - first["block_start"]
    batch_one = decode.get(1, first["block_compute_ms"])
    loaded = loaded_block_ms(base) / batch_one if batch_one > 0 else 1.0
    lone = blocks * batch_one * loaded
    per_row = blocks * (decode[widest] - batch_one) / (widest - 1) * loaded if widest > 1 else 0
    narrowest = min((batch for batch in decode if batch > 1), default=1)
    first_row = blocks * (decode[narrowest] - batch_one) / (narrowest - 1) * loaded if narrowest > 1 else per_row
    fixed = max(0.0, lone - first_row)  # the simulator adds the decoding requests' rows: a batch of one costs `lone`
    rows_ms = tuple((batch, max(0.0, blocks * decode[batch] * loaded - fixed)) for batch in sorted(decode))
    beyond_compute = max(0.0, float(np.percentile(base.tbt(), 10)) * 1000 - lone)
    work = client_work(base.workdir and base.workdir.parent)
    passed = run_marked(base.workdir and base.workdir.parent, CHUNKS_PASSED_FILE)
    delay_ms = max(min(beyond_compute, rtt_ms), beyond_compute - work.pass_ms - work.token_ms)
    untracked = base.untracked_cpu()
    refused_round_ms = untracked.refused_round_ms if untracked is not None else None
    prefill_ms = prefill_token_ms_under_load(base, fixed)
    tries = client_tries_of(base)
    keep_window = kept_window(base.workdir and base.workdir.parent)
    cpu = base.batch_cpu()
    if cpu is not None:  # the costs at the servers' CPU time: the simulator's sharing adds what contention took
        prefill_ms /= cpu.prompt_wall_over_cpu
    config = KunServeSimConfig(
        replicas=len(SERVERS), blocks=blocks, pages_total=first["pages_total"],
        params_pages=first["pages_params"] // blocks * blocks, tokens_per_page=first["kv_tokens_per_page"],
        step_ms=fixed, prefill_token_ms=prefill_ms,
        decode_token_ms=max(0.0, per_row), decode_rows_ms=rows_ms,
        hop_ms=rtt_ms / 2, round_trip_ms=delay_ms,
        client_token_ms=work.token_ms, client_pass_ms=work.pass_ms,
        link_bytes_per_s=exchange_bytes_per_s(exchanged) or MBIT * 1e6 / 8,
        kv_bytes_per_token_block=first["kv_bytes_per_token"],
        prefill_chunk_tokens=DEFAULT_MAX_BATCH_TOKENS["cpu"], dropping=dropping,
        retry_backoff_s=(BUSY_BACKOFF_FIRST_S, BUSY_BACKOFF_MAX_S), refused_window_s=REFUSED_WINDOW_S,
        retry_hint=run_marked(base.workdir and base.workdir.parent, ROOM_NAMED_FILE),
        keep_named=keep_window is not None, keep_window_s=keep_window or (NAMED_ROOM_LEAD_S, NAMED_ROOM_GRACE_S),
        withdraw_waits=run_marked(base.workdir and base.workdir.parent, WAITS_WITHDRAWN_FILE),
        lookup_s=tries.lookup_s, open_s=tries.open_s,
        stopped_prompt_follow_ms=chain_follow_ms(exchanged, tries, rtt_ms),
        records_max_age_s=ClientConfig().records_max_age_s,
        refused_try_cpu_ms=(refused_round_ms if refused_round_ms is not None
                            else refused_try_cpu_ms(base.workdir and base.workdir.parent)),
        token_cpu_ms=untracked.token_ms if untracked is not None else 0.0,
        placement="latency", cores=os.cpu_count() or 1, member_batching=True,
        corun_stretch=corun_stretch(base.workdir and base.workdir.parent),
        work_noise=noise if (noise := batch_noise(base)) is not None else BATCH_NOISE_UNTRACED,
        client_gang_wait_s=MAX_GANG_WAIT_S, join_prefill=not passed, overtake_prefill=passed, exchange_transient=True,
        reserve_decode_rows=True,
        client_link_bytes_per_s=MBIT * 1e6 / 8, hidden_bytes_per_token=hidden_size() * WIRE_BYTES,
        client_link_extra_s=link_crossing_extra(base.workdir and base.workdir.parent, rtt_ms),
    )
    if cpu is None:
        return config
    config = dataclasses.replace(config, other_work_weight=other_work_weight(base, config, cpu.wall_over_cpu))
    return dataclasses.replace(config, round_trip_per_decoding_ms=crowd_delay_ms(base, config))


WEIGHT_RANGE = (0.0, 8.0)  # where `other_work_weight` searches
CROWD_DELAY_REACH_MS = 150.0  # the most `crowd_delay_ms` gives a token for each other request decoding
FIT_STEPS = 12  # bisections


def fitted(base: ArmRun, name: str, config: KunServeSimConfig,
           measure: Callable[[KunServeSimResult, Sequence[SimRequest]], float], target: float,
           bounds: tuple[float, float]) -> float:
    """Gives the value of `config`'s field `name` under which the simulated no-drop arm (`config`, no drop, on
    `base`'s arrivals as recorded) measures `target` (`measure`, rising with the value), by bisection over `bounds`;
    the end nearest to it if none does. A measure that rises only overall (the decode time jumps a few percent as
    batches fall in and out of step) lands on one of its crossings. Kept on `base` (`ArmRun.fits`): the report asks
    for it once per arm and replay set."""
    if (name, config.round_trip_ms) in base.fits:
        return base.fits[name, config.round_trip_ms]
    requests = [SimRequest(r["at_s"], r["prompt_tokens"], r["output_tokens"])
                for r in sorted(base.requests.values(), key=lambda request: request["at_s"])]

    def measured(value: float) -> float:
        return measure(simulate(dataclasses.replace(config, dropping=False, static_groups=1, **{name: value}),
                                requests), requests)

    low, high = bounds
    if measured(high) <= target:
        value = high
    elif measured(low) >= target:
        value = low
    else:
        for _ in range(FIT_STEPS):
            middle = (low + high) / 2
            low, high = (middle, high) if measured(middle) < target else (low, middle)
        value = (low + high) / 2
    base.fits[name, config.round_trip_ms] = value
    return value


def other_work_weight(base: ArmRun, config: KunServeSimConfig, wall_over_cpu: float) -> float:
    """Gives the weight of the machine's other work in the simulator's sharing (`other_work_weight`) under which
    the simulated no-drop arm stretches its servers' batches beyond their work as much as `base`'s servers' batches
    took beyond their CPU time (`wall_over_cpu`), within `WEIGHT_RANGE` (`fitted`)."""
    return fitted(base, "other_work_weight", config, lambda result, _: result.compute_stretch, wall_over_cpu,
                  WEIGHT_RANGE)


def crowd_delay_ms(base: ArmRun, config: KunServeSimConfig) -> float:
    """Gives the delay a token takes outside the simulated work for each other request decoding
    (`round_trip_per_decoding_ms`, beside `config`'s `round_trip_ms`: the least loaded requests' figure) under which
    the simulated no-drop requests decode as long, summed from first token to last, as `base`'s did
    (`ArmRun.decode_s`), within `CROWD_DELAY_REACH_MS` (`fitted`)."""
    return fitted(base, "round_trip_per_decoding_ms", config, decoded_s, base.decode_s(), (0.0, CROWD_DELAY_REACH_MS))


def delay_text(config: KunServeSimConfig) -> str:
    """Gives a token's delay outside the simulated work as the report states it."""
    return (f"{config.round_trip_ms:.0f} ms + {config.round_trip_per_decoding_ms:.1f} ms for each other request "
            f"decoding (up to {config.round_trip_crowd_cap})")


def decoded_s(result: KunServeSimResult, requests: Sequence[SimRequest]) -> float:
    """Gives how long a simulation of `requests` decoded them, summed from each one's first token to its last."""
    return float(np.nansum([tbt * (request.output - 1) for tbt, request in zip(result.tbt_s, requests, strict=True)
                            if request.output > 1]))


@functools.cache
def hidden_size() -> int:
    """Gives the hidden size of the served model (its converted checkpoint's config)."""
    return int(resolve_model(DEFAULT_MODEL).config.hidden_size)


def loaded_block_ms(run: ArmRun) -> float:
    """Gives what a lone decode step took a block while `run` loaded its servers: the median, over both servers'
    polls from the first that shows it refined, of their `block_compute_ms` (each server's running mean of its lone
    decode steps' compute per block, from its start-up timing on). It came to 2-3x the start-up timing of bare blocks
    (r14, r15): a real step also reads the session's KV pages and runs beside the other processes of one machine;
    a loopback server with one session took 2x. A run whose servers computed no lone step: the start-up timing."""
    refined = [row["block_compute_ms"] for rows in run.polls_by_peer() for row in rows
               if row["block_compute_ms"] != rows[0]["block_compute_ms"]]
    first = min(run.polls, key=lambda row: row["t"])
    return statistics.median(refined) if refined else first["block_compute_ms"]


def batch_noise(run: ArmRun) -> float | None:
    """Gives how much `run`'s servers' batches varied in CPU time beyond what their tokens say: the standard deviation
    of the log of each batch's CPU time over a least-squares fit, per server, in its prompt tokens and decode rows
    (`server.batch_trace`; a peer's remote-attention steps, which wait on a peer, left out), pooled over the servers;
    None for runs kept without batch traces (before r89)."""
    residuals: list[np.ndarray] = []
    for host in SERVERS:
        path = run.workdir / f"{host}{BATCH_TRACE_SUFFIX}" if run.workdir is not None else None
        if path is None or not path.is_file():
            continue
        rows = [(sum(tokens for _, tokens, decode, _ in record["steps"] if not decode),
                 sum(1 for _, _, decode, _ in record["steps"] if decode), record["cpu_ms"])
                for record in _read_jsonl(path) if record["place"] != "remote" and record["cpu_ms"] > 0]
        if len(rows) < BATCH_NOISE_MIN_BATCHES:
            continue
        prompt, decode, cpu = np.array(rows, dtype=float).T
        fit = np.c_[np.ones_like(cpu), prompt, decode]
        coefficients, *_ = np.linalg.lstsq(fit, cpu, rcond=None)
        residuals.append(np.log(cpu / np.maximum(fit @ coefficients, BATCH_NOISE_FLOOR_MS)))
    return float(np.concatenate(residuals).std()) if residuals else None


def exchange_bytes_per_s(runs: Sequence[ArmRun]) -> float | None:
    """Gives how fast the servers of `runs` moved sessions' KV to a peer: the bytes they sent over the time their
    sends took, summed over the servers and runs (`info` migrations); None if they moved none. On the emulated
    100 Mbit/s links the moves ran at 29 Mbit/s at 40 ms and 58 at 20 ms (r6, pooled): each chunk waits for its
    peer's answer, and the cores are shared."""
    sent, took_ms = 0, 0.0
    for run in runs:
        for row in run.last_polls().values():
            migrations = row.get("migrations") or {}
            sent += migrations.get("bytes_out", 0)
            took_ms += migrations.get("ms_out", 0.0)
    return sent / (took_ms / 1000) if sent and took_ms else None


CLIENT_WORK_FILE = "client_work.json"  # in the run's workdir: the report reads it again
REFUSED_TRIES_FILE = "refused_tries.json"  # in the run's workdir: the report reads it again
# In the run's workdir, per RTT: the report reads it again. Runs before r93 kept the rig's reading on warmed streams
# only (`LINK_CROSSING_FILE`); from r93 it also holds the new streams' (`LINK_STREAMS_FILE`)
LINK_CROSSING_FILE, LINK_STREAMS_FILE = "link_crossing_{rtt}.json", "link_streams_{rtt}.json"
CORUN_FILE = "corun.json"  # in the run's workdir: the report reads it again
# Markers in a run's workdir of what its servers and clients did: named when their sessions' ends make room (from
# r50, `run_marked`), kept that room for the wait they named it to (from r54, `kept_window`), and withdrew a wait from
# the servers that had refused it once it opened on another (from r57)
ROOM_NAMED_FILE, ROOM_KEPT_FILE = "servers_name_room", "servers_keep_named_room"
WAITS_WITHDRAWN_FILE = "clients_withdraw_waits"
CHUNKS_PASSED_FILE = "servers_pass_prompt_chunks"  # from r79: decode steps pass a prompt chunk's batch, not join it
REFUSED_TRIES_KV_PAGES = 3  # KV pages per block of the servers that measure a refused round (full either way)
CLIENT_WORK_SESSIONS = 8  # sessions whose tokens share the client's passes when its work is measured (the most the
# dropped arms run at once)


def kept_reading(workdir: Path | None, name: str, measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Gives the reading kept as `name` in `workdir`, else takes it with `measure` and keeps it there (dated), so
    that reporting a kept run again gives the same simulation."""
    kept = workdir / name if workdir is not None else None
    if kept is not None and kept.is_file():
        return json.loads(kept.read_text())
    reading = {**measure(), "measured": datetime.datetime.now().isoformat()}
    if kept is not None:
        kept.write_text(json.dumps(reading))
    return reading


def client_work(workdir: Path | None) -> ClientWork:
    """Gives the client's CPU per head pass and per token on this machine (`benchmarks.client_work`: a loopback swarm
    of one server with the no-drop arm's flags). Measured once per run and kept in `workdir`."""
    reading = kept_reading(workdir, CLIENT_WORK_FILE, lambda: dataclasses.asdict(_measured_client_work()))
    return ClientWork(reading["pass_ms"], reading["token_ms"], Round(**reading["lone"]), Round(**reading["shared"]),
                      reading["sessions"])


def corun_stretch(workdir: Path | None) -> float:
    """Gives how many times its wall time over its CPU time alone the servers' work took this machine with every
    core computing (`benchmarks.corun`). Measured once per run and kept in `workdir`, as the client's work is: a run
    kept without it is measured when it is reported again, on the machine that reports it."""
    return float(kept_reading(workdir, CORUN_FILE, lambda: dataclasses.asdict(_measured_corun()))["stretch"])


@functools.cache
def _measured_corun() -> Corun:
    return measure_corun()


@functools.cache
def _measured_client_work() -> ClientWork:
    return measure_client_work(server_flags("no drop", "a", CLIENT_WORK_SESSIONS)[1],
                               max_length=MAX_PROMPT + MAX_OUTPUT, sessions=CLIENT_WORK_SESSIONS)


def link_crossing_extra(workdir: Path | None, rtt_ms: float, measure: bool = False) -> tuple[tuple[int, float], ...]:
    """Gives what a prompt's message took on the emulated link at `rtt_ms` beyond its bytes at the link's rate, by
    size in bytes (`benchmarks.link_crossing`: two hosts of an emulated network as the arms', `LinkCrossing.
    relayed_extra_s`: on a new stream, as each session's prompt crosses), as kept in `workdir`. With `measure` (the
    live run, once per RTT before its arms; needs root), the rig takes it where none is kept; without, as the
    simulator's fit asks, a run kept with only the warmed streams' reading gives that one, and a run kept without
    either none (every message at the link's rate)."""
    def kept(name: str) -> bool:
        return workdir is not None and (workdir / name).is_file()

    name = LINK_STREAMS_FILE.format(rtt=f"{rtt_ms:g}")
    if not measure and not kept(name):
        name = LINK_CROSSING_FILE.format(rtt=f"{rtt_ms:g}")  # a run kept before r93
        if not kept(name):
            return ()
    reading = kept_reading(workdir, name, lambda: dataclasses.asdict(measure_link_crossing(rtt_ms)))
    reading.pop("measured")
    return LinkCrossing(**reading).relayed_extra_s()


def run_marked(workdir: Path | None, marker: str) -> bool:
    """Gives whether the run kept in `workdir` was recorded with `marker` (`ROOM_NAMED_FILE`: with servers that, when
    full, named when their sessions' ends make room, `ServerBusy.retry_after_s`, `SessionTable.room_in_s`)."""
    return workdir is not None and (workdir / marker).is_file()


def kept_window(workdir: Path | None) -> tuple[float, float] | None:
    """Gives how long before and after a named time the servers of the run kept in `workdir` kept the room they had
    named (`ROOM_KEPT_FILE`, `SessionTable.kept_for_named`); None if they did not keep it (runs before r54)."""
    if not run_marked(workdir, ROOM_KEPT_FILE):
        return None
    assert workdir is not None
    window = json.loads((workdir / ROOM_KEPT_FILE).read_text())
    return float(window["lead_s"]), float(window["grace_s"])


def refused_try_cpu_ms(workdir: Path | None) -> float:
    """Gives the CPU a waiting client's refused round costs this machine (ms, `benchmarks.refused_tries`: a loopback
    swarm of two full servers with the no-drop arm's flags). Measured once per run and kept in `workdir`."""
    return float(kept_reading(workdir, REFUSED_TRIES_FILE,
                              lambda: dataclasses.asdict(_measured_refused_tries()))["cpu_ms"])


@functools.cache
def _measured_refused_tries() -> RefusedTries:
    return measure_refused_tries(server_flags("no drop", "a", REFUSED_TRIES_KV_PAGES)[1],
                                 max_length=MAX_PROMPT + MAX_OUTPUT)


LOOKUP_MIN_S = 0.01  # a client's route that took longer looked the DHT up; faster ones routed on recent records


@dataclass(frozen=True)
class ClientTries:
    """What a client's try to open a session took in a run (`client_tries_of`)."""

    lookup_s: float  # a DHT lookup, the median of the routes that made one
    open_s: float  # an `open` call on one server, the median of all (admitted or refused)


def client_tries_of(run: ArmRun) -> ClientTries:
    """Gives what the run's clients' tries took (`open_attempts`): a DHT lookup (the routes slower than
    `LOOKUP_MIN_S`: the others routed on records a try had looked up within `ClientConfig.records_max_age_s`) and
    one `open` call. Runs recorded before clients logged their attempts: zeros."""
    routes, opens = [], []
    for result in run.results:
        for kind, started_s, ended_s, _peer, _outcome in result.get("open_attempts", ()):
            if kind == "route" and ended_s - started_s >= LOOKUP_MIN_S:
                routes.append(ended_s - started_s)
            elif kind == "open":
                opens.append(ended_s - started_s)
    return ClientTries(statistics.median(routes) if routes else 0.0, statistics.median(opens) if opens else 0.0)


def chain_follow_ms(exchanged: Sequence[ArmRun], tries: ClientTries, rtt_ms: float) -> float:
    """Gives how long after a drop stopped a victim's prompt its client sends it again through the group (the
    simulator's `stopped_prompt_follow_ms`): the victim's part moving to the member that keeps its blocks (two round
    trips: its open there and the answer), the servers' `ChainChanged` reaching the client (a hop), and the client
    following it: the median of the follows that the clients of the runs that dropped recorded (`chain_follows`, from
    r60), else a DHT lookup and a dial (an `open` call's time), as the clients before r60 followed."""
    follows = [ended_s - started_s for run in exchanged for result in run.results
               for started_s, ended_s, followed in result.get("chain_follows", ()) if followed]
    own_s = statistics.median(follows) if follows else tries.lookup_s + tries.open_s
    return 2.5 * rtt_ms + own_s * 1000


def batch_counters(run: ArmRun) -> dict[str, float]:
    """Gives what the servers' batch counters (`info` batches) grew by over the run, summed over the servers: prompt
    tokens, the batches that held them and their compute, and all compute (ms)."""
    grown = {"prefill_tokens": 0.0, "prefill_batches": 0.0, "prefill_batch_ms": 0.0, "compute_ms": 0.0}
    for rows in run.polls_by_peer(counted=True):
        first, last = rows[0]["batches"], rows[-1]["batches"]
        for name in grown:
            grown[name] += last.get(name, 0) - first.get(name, 0)  # prefill_batches: 0 in runs before it was counted
    return grown


def prefill_token_ms_under_load(base: ArmRun, step_ms: float) -> float:
    """Gives a prompt token's cost through all blocks while the no-drop arm ran: the servers' compute of the batches
    that held prompt tokens, less the fixed `step_ms` of each (the simulator adds it per chunk), over those tokens
    (`info` batches), summed over the servers. Runs recorded before the servers counted those batches: their compute
    whole. Runs recorded before the servers counted prompt tokens: the median of (first token - session open) /
    prompt tokens, which includes waiting."""
    grown = batch_counters(base)
    if grown["prefill_tokens"] > 0:
        return max(0.0, grown["prefill_batch_ms"] - grown["prefill_batches"] * step_ms) / grown["prefill_tokens"]
    return statistics.median((r["first_token_s"] - r["started_s"]) * 1000 / base.requests[r["id"]]["prompt_tokens"]
                             for r in base.served)


@dataclass(frozen=True)
class LoadedSpeeds:
    """What a token took of a loaded server's compute through all 30 blocks, from the servers' batch counters."""

    prompt_token_ms: float  # the batches that held prompt tokens, over those tokens
    output_token_ms: float  # every other batch, over the decode steps the sessions took


def loaded_speeds(run: ArmRun) -> LoadedSpeeds:
    """Gives the speeds the no-drop swarm's servers measured in `run`. A decode step batched with a prompt counts in
    the prompt's batch, so the output token's figure is a little low."""
    grown = batch_counters(run)
    steps = sum(run.requests[r["id"]]["output_tokens"] - 1 for r in run.served)
    return LoadedSpeeds(grown["prefill_batch_ms"] / max(1.0, grown["prefill_tokens"]),
                        (grown["compute_ms"] - grown["prefill_batch_ms"]) / max(1, steps))


def busiest_share(requests: list[dict], speeds: LoadedSpeeds) -> float:
    """Gives the share of the servers' compute that the requests arriving in the busiest `BUSIEST_S` ask for: their
    prompt tokens and decode steps at `speeds`."""
    arrivals = np.array([r["at_s"] for r in requests])
    work_ms = np.array([r["prompt_tokens"] * speeds.prompt_token_ms + (r["output_tokens"] - 1) * speeds.output_token_ms
                        for r in requests])
    busiest = max(float(work_ms[(arrivals >= start) & (arrivals < start + BUSIEST_S)].sum()) for start in arrivals)
    return busiest / (len(SERVERS) * BUSIEST_S * 1000)


def sized_rate(args: argparse.Namespace, speeds: LoadedSpeeds) -> float:
    """Gives the mean arrival rate at which the busiest `BUSIEST_S` ask `COMPUTE_SHARE` of the servers' compute, so
    that KV throttles before the cores do (spec 5.8). Bisection: the share grows with the rate."""
    low, high = 0.01, 10.0
    for _ in range(30):
        middle = math.sqrt(low * high)
        if busiest_share(burst_requests(args, middle), speeds) > COMPUTE_SHARE:
            high = middle
        else:
            low = middle
    return math.floor(low * 1000) / 1000  # three decimals, never above the share


@dataclass(frozen=True)
class Calibration:
    """What the calibration run measured: the loaded servers' speeds, a session's median TTFT and TBT, and the
    sessions a server's pool held beyond `CALIBRATION_KV_PAGES` (the pool's alignment pages)."""

    speeds: LoadedSpeeds
    ttft_s: float
    tbt_s: float
    spare_sessions: int


def peak_sessions(requests: list[dict], calibration: Calibration) -> int:
    """Gives the most sessions open at once if every request opened on arrival and ran at the calibrated TTFT and
    TBT: what the busiest moment asks of the pools."""
    events = sorted(event for r in requests for event in (
        (r["at_s"] + calibration.ttft_s + (r["output_tokens"] - 1) * calibration.tbt_s, -1), (r["at_s"], 1)))
    open_now = most = 0
    for _, change in events:
        open_now += change
        most = max(most, open_now)
    return most


def sized_pool(requests: list[dict], calibration: Calibration) -> int:
    """Gives the KV pages per block of a server's pool (a session takes one per block) such that the busiest moment
    asks `KV_OVERLOAD` times the sessions the two servers hold undropped (at least one each)."""
    per_server = max(1, math.floor(peak_sessions(requests, calibration) / (len(SERVERS) * KV_OVERLOAD)))
    return max(1, per_server - calibration.spare_sessions)


def calibration_requests(args: argparse.Namespace) -> list[dict]:
    """Gives `CALIBRATION_REQUESTS` of the window's requests, spread over it, one every `CALIBRATION_GAP_S`."""
    window = burst_requests(args, 1.0)
    chosen = window[:: max(1, len(window) // CALIBRATION_REQUESTS)][:CALIBRATION_REQUESTS]
    return [{**request, "id": n, "at_s": n * CALIBRATION_GAP_S} for n, request in enumerate(chosen)]


def calibrate(rtt_ms: float, args: argparse.Namespace, workdir: Path) -> Calibration:
    """Runs the no-drop swarm on `calibration_requests` and gives what its sessions and loaded servers measured."""
    run = run_arm("no drop", rtt_ms, calibration_requests(args), CALIBRATION_KV_PAGES, args, workdir,
                  label="calibration")
    last = max(run.polls, key=lambda row: row["t"])
    held = (last["pages_total"] - last["pages_params"]) // (last["block_end"] - last["block_start"])
    return Calibration(loaded_speeds(run), float(np.median(run.ttft())), float(np.median(run.tbt())),
                       max(0, held - CALIBRATION_KV_PAGES))


# arm -> how the simulator runs it: dropping, live exchange, static groups (the static pipeline: one pair throughout)
SIMULATED_ARMS = {
    "no drop": (False, False, 1),
    "static pipeline": (False, False, len(SERVERS)),
    "KunServe blocking": (True, False, 1),
    "KunServe remote attention": (True, True, 1),
}


SIM_REPLAYS = 21  # the simulator's replays of one arm: the arrivals as recorded, and jittered with seeds 1..20
SIM_JITTER_S = 0.05  # each jittered replay moves every arrival by up to this, either way
SENSITIVITY = 0.05  # the report's sensitivity: every compute cost this much lower and higher


def member_prompt_scale(base: ArmRun, run: ArmRun) -> float | None:
    """Gives how many times as long a prompt token took a block on `run`'s servers while they hosted a slice (the
    fewest blocks they hosted) as on `base`'s whole servers (`ArmRun.compute_by_blocks`): in CPU time where both
    runs' servers counted it (the simulator is then fitted on CPU time, `sim_config`), else in wall time; None if
    `run` never hosted fewer blocks than `base`, or either computed no prompt token."""
    whole, own = base.compute_by_blocks(), run.compute_by_blocks()
    if not whole or not own or min(own) >= max(whole):
        return None
    slice_, full = own[min(own)], whole[max(whole)]
    scale = slice_.prompt_cpu_us_per_token_block / full.prompt_cpu_us_per_token_block
    if not math.isfinite(scale) or base.batch_cpu() is None:
        scale = slice_.prompt_us_per_token_block / full.prompt_us_per_token_block
    return scale if math.isfinite(scale) else None


def arm_speed_scale(base: ArmRun, run: ArmRun) -> float | None:
    """Gives how many times as long `run`'s servers took a prompt token through a block, in CPU time, as `base`'s
    did (`ArmRun.batch_cpu`): how much slower this machine computed while `run` ran than while `base` did (its speed
    moved 5-30% between the arms of one turn, r35-r36); None unless both runs' servers counted CPU."""
    own, fitted = run.batch_cpu(), base.batch_cpu()
    if own is None or fitted is None:
        return None
    return own.prompt_us_per_token_block / fitted.prompt_us_per_token_block


def scaled_costs(config: KunServeSimConfig, scale: float) -> KunServeSimConfig:
    """Gives `config` with every CPU cost `scale` times as high, as on a machine computing that much slower: the
    servers' (a batch's fixed part, a decoding request's row and the batching curve of decode rows, a prompt token)
    and those of the processes beside them (the client's head pass and token, a token's and a refused try's CPU in
    the other processes) [until stop 70 the servers' only, and not their batching curve of decode rows: a decode batch
    without prompt tokens kept the no-drop arm's speed]. Network times (hops, crossings, lookups) stay."""
    return dataclasses.replace(
        config, step_ms=config.step_ms * scale, decode_token_ms=config.decode_token_ms * scale,
        decode_rows_ms=tuple((rows, ms * scale) for rows, ms in config.decode_rows_ms),
        prefill_token_ms=config.prefill_token_ms * scale, client_pass_ms=config.client_pass_ms * scale,
        client_token_ms=config.client_token_ms * scale, token_cpu_ms=config.token_cpu_ms * scale,
        refused_try_cpu_ms=config.refused_try_cpu_ms * scale)


def sim_p99_ttft(base: ArmRun, rtt_ms: float, arm: str, exchanged: Sequence[ArmRun] = (),
                 member_scale: float | None = None, cost_scale: float = 1.0,
                 replays: int = SIM_REPLAYS) -> list[float]:
    """Gives the simulator's P99 TTFT of `arm` on the requests of `base` in each of `replays` replays (`sim_ttfts`)."""
    return [pct(ttft[np.isfinite(ttft)], 99)
            for ttft in sim_ttfts(base, rtt_ms, arm, exchanged, member_scale, cost_scale, replays)]


def sim_ttfts(base: ArmRun, rtt_ms: float, arm: str, exchanged: Sequence[ArmRun] = (),
              member_scale: float | None = None, cost_scale: float = 1.0,
              replays: int = SIM_REPLAYS) -> list[np.ndarray]:
    """Gives the simulator's TTFT of every request of `base` (s; NaN if it never started) as `arm`, with its geometry
    and speeds, in each of `replays` replays: the arrivals as recorded, then moved by up to `SIM_JITTER_S` either way
    (seeded). Where clients back off, which client gets a freed slot turns on milliseconds, and the P99 with it; the
    replays show how far. With `member_scale`, a group's prompt token costs that many times a whole replica's
    (`member_prompt_scale` of the arm's own run); with `cost_scale`, every CPU cost is that many times the fitted
    one (`scaled_costs`)."""
    dropping, live_exchange, groups = SIMULATED_ARMS[arm]
    fitted = scaled_costs(sim_config(base, rtt_ms, dropping, exchanged), cost_scale)
    config = dataclasses.replace(fitted, live_exchange=live_exchange, static_groups=groups,
                                 member_prefill_token_ms=(fitted.prefill_token_ms * member_scale
                                                          if member_scale is not None else None))
    requests = sorted(base.requests.values(), key=lambda request: request["id"])
    ttfts = []
    for seed in range(replays):
        shift = np.random.default_rng(seed).uniform(-SIM_JITTER_S, SIM_JITTER_S, len(requests)) if seed else None
        sim_requests = [SimRequest(max(0.0, r["at_s"] + (shift[i] if shift is not None else 0.0)), r["prompt_tokens"],
                                   r["output_tokens"]) for i, r in enumerate(requests)]
        result = simulate(dataclasses.replace(config, placement_seed=seed),
                          sorted(sim_requests, key=lambda request: request.arrival_s))
        ttfts.append(result.ttft_s)
    return ttfts


def pct(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if values.size else math.nan


def arm_dir(root: Path, rtt_ms: float, arm: str, repeat: int = 0) -> Path:
    """Gives where the `repeat`-th run (from 0) of `arm` at `rtt_ms` keeps its files under `root`."""
    return root / (f"{rtt_ms:g}-{arm.replace(' ', '-')}" + (f"-r{repeat + 1}" if repeat else ""))


def kept_repeats(root: Path, rtt_ms: float, arm: str) -> list[ArmRun]:
    """Gives every run of `arm` at `rtt_ms` kept under `root`: the first, then its repeats while their folders go on."""
    runs = [load_arm(arm, arm_dir(root, rtt_ms, arm))]
    while arm_dir(root, rtt_ms, arm, len(runs)).is_dir():
        runs.append(load_arm(arm, arm_dir(root, rtt_ms, arm, len(runs))))
    return runs


def slice_scale(runs: dict[str, list[ArmRun]], turn: int) -> float | None:
    """Gives how many times as long a prompt token took a block on the servers of turn `turn`'s static pipeline,
    each hosting a slice, as on that turn's whole no-drop servers (`member_prompt_scale`): what the simulator of that
    turn charges a group member's prompt token over a whole replica's; None if no static pipeline ran that turn.

    A server that hosts a slice computes a prompt token through a block 5-15% slower than a whole server (r39-r43:
    x0.98-1.15, in CPU time, every turn but one above 1.05): it carries more sessions' decode rows beside each chunk
    (3.6 open sessions per busy member against 1.4 in r43), and what a batch costs beyond its blocks spreads over
    half as many. The static pipeline measures it on servers that host a slice all the run, as the no-drop arm
    measures whole ones; the KunServe arms, whose servers host both in turn, are then predicted from the two."""
    repeats = runs.get("static pipeline", [])
    if turn >= len(repeats) or not repeats[turn].served:
        return None
    return member_prompt_scale(runs["no drop"][turn], repeats[turn])


def turn_fit(runs: dict[str, list[ArmRun]], turn: int) -> tuple[ArmRun, list[ArmRun]]:
    """Gives what the simulator of turn `turn` (from 0) is fitted on: that turn's no-drop run, and that turn's runs
    that dropped (their KV moves)."""
    exchanged = [repeats[turn] for name, repeats in runs.items()
                 if SIMULATED_ARMS.get(name, (False,))[0] and turn < len(repeats)]
    return runs["no drop"][turn], exchanged


def report(rtt_ms: float, runs: dict[str, list[ArmRun]]) -> None:
    """Prints the arms' table (a row per run: `runs` holds each arm's repeats, in the order they ran), their targets
    against the no-drop run of the same turn, the pages over time of the first turn, and the simulator against the
    median of the repeats' live P99 TTFT."""
    base = runs["no drop"][0]
    reference = {r["id"]: r.get("tokens") for r in base.served}
    turns = max(len(repeats) for repeats in runs.values())
    spans = [f"{len(run.requests)} requests over {max(r['at_s'] for r in run.requests.values()):.0f} s"
             for run in runs["no drop"]]
    print(f"\nRTT {rtt_ms:g} ms, {' | '.join(dict.fromkeys(spans))}"
          + (f", {turns} turns of the arms (#2 on: the turn's row; tokens compared with the first no-drop run's)"
             if turns > 1 else ""))
    print(f"{'arm':<30} {'TTFT p50':>8} {'TTFT p99':>8} {'gain':>6} {'TBT p50':>8} {'TBT p99':>8} {'ratio':>6} "
          f"{'stall mx':>8} {'stall mn':>8} {'drops':>5} {'rest.':>5} {'differ':>6} {'errors':>6}")
    print(f"{'':<30} {'s':>8} {'s':>8} {'':>6} {'ms':>8} {'ms':>8} {'':>6} {'s':>8} {'s':>8}")
    for turn in range(turns):
        turn_base = runs["no drop"][min(turn, len(runs["no drop"]) - 1)]
        base_ttft99, base_tbt50 = pct(turn_base.ttft(), 99), pct(turn_base.tbt(), 50)
        for arm in ARMS:
            repeats = runs.get(arm, [])
            name = arm + (f" #{turn + 1}" if turn else "")
            if turn >= len(repeats):
                if turn == 0:
                    print(f"{name:<30} not run (--arms)")
                continue
            run = repeats[turn]
            ttft, tbt = run.ttft(), run.tbt()
            stall_max, stall_mean, drops, restores = run.exchange()
            differ = sum(1 for r in run.served if r.get("tokens") != reference.get(r["id"]))
            errors = sum(1 for r in run.results if "error" in r)
            gain = base_ttft99 / pct(ttft, 99) if ttft.size else math.nan
            ratio = pct(tbt, 50) / base_tbt50 if tbt.size else math.nan
            print(f"{name:<30} {pct(ttft, 50):8.2f} {pct(ttft, 99):8.2f} {gain:5.1f}x {pct(tbt, 50) * 1000:8.0f} "
                  f"{pct(tbt, 99) * 1000:8.0f} {ratio:5.2f}x {stall_max:8.2f} {stall_mean:8.2f} {drops:5d} "
                  f"{restores:5d} {differ:6d} {errors:6d}")
        for arm in ("KunServe blocking", "KunServe remote attention"):
            repeats = runs.get(arm, [])
            if turn >= len(repeats) or not repeats[turn].served:
                continue
            run = repeats[turn]
            gain = base_ttft99 / pct(run.ttft(), 99)
            ratio = pct(run.tbt(), 50) / base_tbt50
            print(f"targets, {arm}{f' #{turn + 1}' if turn else ''}: P99 TTFT >= {TARGET_TTFT_GAIN:g}x lower than "
                  f"no drop: {gain:.1f}x {'MET' if gain >= TARGET_TTFT_GAIN else 'NOT MET'}; TBT P50 within "
                  f"{TARGET_TBT_RATIO:g}x: {ratio:.2f}x {'MET' if ratio <= TARGET_TBT_RATIO else 'NOT MET'}")
    for turn, live in enumerate(runs.get("KunServe remote attention", [])):
        stats = live.live()
        print(f"remote attention{f' #{turn + 1}' if turn else ''}, both servers: {stats['lent_sessions']} victims "
              f"lent their KV, {stats['attends_sent']} attends (mean {stats['attend_ms_mean']:.1f} ms a round trip), "
              f"{stats['switched_blocks']} blocks switched to their keeper, {stats['copied_bytes'] / 1e6:.1f} MB "
              f"copied, {stats['lost']} sessions lost their lender")
    print("servers' compute by the blocks they hosted, turn 1 (prompt tokens: us per token and block | other batches: "
          "ms per batch and block | open sessions per busy server):")
    for arm in ARMS:
        if runs.get(arm):
            print(f"  {arm:<26} " + "; ".join(
                f"{blocks} blocks: {state.prompt_us_per_token_block:.0f} us | {state.other_ms_per_batch_block:.2f} ms"
                f" | {state.sessions:.1f} ({state.prompt_tokens} prompt tokens)"
                for blocks, state in runs[arm][0].compute_by_blocks().items()))
    print("servers' decode steps, turn 1, both servers (how many, and their mean latency at the server): alone | "
          "beside a prompt's chunk | passing one:")
    for arm in ARMS:
        if runs.get(arm):
            print(f"  {arm:<26} " + " | ".join(f"{count:5d} x {mean_ms:5.1f} ms"
                                             for count, mean_ms in runs[arm][0].decode_steps().values()))
    counted = {arm: [run.batch_cpu() for run in runs.get(arm, [])] for arm in ARMS}
    if any(cpu is not None for cpus in counted.values() for cpu in cpus):
        print("servers' batches by turn, their computing threads' CPU (the machine's speed: us per prompt token and "
              "block | the contention they computed under: wall time over CPU time):")
        for arm, cpus in counted.items():
            print(f"  {arm:<26} " + " ".join(f"{cpu.prompt_us_per_token_block:5.0f} us | {cpu.wall_over_cpu:.2f}x"
                                             if cpu is not None else "     -" for cpu in cpus))
    kunserve = runs.get("KunServe blocking", [None])[0]
    if kunserve is not None and kunserve.served:
        print("KV pages held / pages that can hold KV, both servers, 5-s windows (KunServe | no drop):")
        for name, run in (("KunServe", kunserve), ("no drop", base)):
            windows: dict[int, tuple[int, int]] = {}
            for t, held, capacity in run.pages_series():
                if t >= 0:
                    window = int(t // WINDOW_S)
                    windows[window] = (max(windows.get(window, (0, 0))[0], held), capacity)
            print(f"  {name:<9} " + " ".join(f"{held}/{capacity}" for _, (held, capacity) in sorted(windows.items())))
    if base.served and any(runs.get(arm) for arm in SIMULATED_ARMS if arm != "no drop"):
        report_sim(rtt_ms, runs)


def report_sim(rtt_ms: float, runs: dict[str, list[ArmRun]]) -> None:
    """Prints the simulator's P99 TTFT of every arm against the live one, run by run: each turn's simulator is fitted
    on that turn's no-drop run (`turn_fit`), since what a step costs moves between turns as this machine's speed does.
    The headline then prices each arm at its own servers' measured speed (`arm_speed_scale`), which moves between the
    arms of a turn too; the turn's fit prices them all at the no-drop arm's, a group member's prompt token at what
    that turn's static pipeline measured (`slice_scale`). With more than one turn, per arm, the median over the turns
    of the simulated P99s against that of the live ones."""
    turns = len(runs["no drop"])
    fits = [turn_fit(runs, turn) for turn in range(turns)]
    slices = [slice_scale(runs, turn) for turn in range(turns)]
    for turn, (base, exchanged) in enumerate(fits):
        fitted = sim_config(base, rtt_ms, True, exchanged)
        member = (f" (x{slices[turn]:.2f} on a server hosting a slice, as the turn's static pipeline measured it)"
                  if slices[turn] is not None else "")
        speeds = (f"iteration {fitted.step_ms:.0f} ms + {fitted.decode_token_ms:.1f} ms per decoding request + "
                  f"{fitted.prefill_token_ms:.2f} ms per prompt token{member}, the machine's other work weighing "
                  f"{fitted.other_work_weight:.2f}x its CPU")
        if turn:
            print(f"  turn {turn + 1}'s fit: {speeds}, a token's delay beyond the work {delay_text(fitted)}, "
                  f"victims' KV at {fitted.link_bytes_per_s * 8 / 1e6:.0f} Mbit/s, {tries_text(fitted)}")
            continue
        each = ", fitted on each turn" if turns > 1 else ""
        print(f"simulator (same requests, the live swarm's geometry and speeds{each}: {speeds}, the client's work "
              f"{fitted.client_pass_ms:.0f} ms a head pass and {fitted.client_token_ms:.0f} ms a token in it, a "
              f"token's delay beyond the work {delay_text(fitted)}, hop {fitted.hop_ms:g} ms, victims' KV at "
              f"{fitted.link_bytes_per_s * 8 / 1e6:.0f} Mbit/s, a victim's prompt sent again "
              f"{fitted.stopped_prompt_follow_ms or 0:.0f} ms after the drop stopped it, {tries_text(fitted)} and, "
              f"when refused, "
              f"{fitted.refused_try_cpu_ms:.0f} ms of CPU; "
              f"sessions to either whole replica with room at random, {fitted.cores} cores shared, work x"
              f"{fitted.corun_stretch:.2f} with every core computing as measured on this machine, each batch's "
              f"work varying by a factor of log-sd {fitted.work_noise:.2f} as the no-drop servers' batches' CPU did) "
              f"against live, P99 TTFT: "
              f"the median of {SIM_REPLAYS} replays (the arrivals as recorded, and moved by up to "
              f"{SIM_JITTER_S * 1000:.0f} ms) and their 10-90%:")
    report_untracked(runs)
    report_live_spread(runs)
    # each reading: its heading, and the scale it takes from the arm's own run into `sim_p99_ttft`'s keyword (the
    # turn's fit takes a member's from the turn's static pipeline, `slice_scale`, and shows it in the fit above). The
    # first is the headline: this machine's speed moves 5-16% between the arms of one turn (r35-r36, r65-r66), and a
    # 5% move in every compute cost moves the simulated P99 by about 10%
    readings: tuple[tuple[str, Callable[[ArmRun, ArmRun], float | None] | None, str], ...] = (
        ("  at each arm's own speed (the headline): every CPU cost (`scaled_costs`) at the speed of the arm's own "
         "servers, their CPU per prompt token and block over the no-drop servers' (`arm_speed_scale`, per arm and "
         "turn):",
         arm_speed_scale, "cost_scale"),
        ("  at the turn's fit: every arm at the no-drop servers' speed, a group's prompt token at the turn's static "
         "pipeline's:", None, ""),
        ("  the same, a group's prompt token at what the arm's own servers measured while they hosted a slice, "
         "against the whole no-drop servers (`member_prompt_scale`, per arm and turn):", member_prompt_scale,
         "member_scale"))
    for heading, scale_of, keyword in readings:
        print(heading)
        within, compared = 0, 0
        for arm in SIMULATED_ARMS:
            lives, sims = [], []
            for turn, run in enumerate(runs.get(arm, [])[:turns]):
                base, exchanged = fits[turn]
                scale = scale_of(base, run) if scale_of is not None else None
                if not run.served or (scale_of is not None and scale is None):
                    continue
                scaled: dict[str, float] = {keyword: scale} if scale is not None else {}
                if scale_of is None and slices[turn] is not None:
                    scaled["member_scale"] = slices[turn]
                replays = np.array(sim_p99_ttft(base, rtt_ms, arm, exchanged, **scaled))
                low, sim, high = np.percentile(replays, [10, 50, 90])
                lives.append(pct(run.ttft(), 99))
                sims.append(float(sim))
                name = arm + (f" #{turn + 1}" if turn else "") + (f" (x{scale:.2f})" if scale is not None else "")
                met = sim_line(name, lives[-1], sims[-1], (float(low), float(high)))
                within, compared = within + met, compared + 1
            if len(lives) > 1:
                sim_line(f"{arm}, median", statistics.median(lives), statistics.median(sims))
        print(f"  {within} of {compared} runs within {TARGET_SIM:.0%}")
    report_sensitivity(rtt_ms, runs, fits, slices)


POOLED_QUANTILES = (50, 95, 99)
POOLED_DRAWS = 2000  # bootstrap draws of the pooled live P99 (`pooled_p99_interval`)
POOLED_INTERVAL = (5, 95)  # the share of those draws the report's interval spans


def pooled_p99_interval(lives: Sequence[np.ndarray], *, draws: int = POOLED_DRAWS,
                        seed: int = 0) -> tuple[float, float]:
    """Gives the 5-95% range of the P99 over `lives` (each run's TTFTs) in a two-level bootstrap: draw as many runs as
    there are, with replacement, then each drawn run's requests, with replacement. It says how far the pooled live
    P99 itself would move on other runs of the same arm: the runs differ (their machine, their lottery of freed
    slots), and within a run the P99 stands on a few waits."""
    rng = np.random.default_rng(seed)
    p99s = np.empty(draws)
    for draw in range(draws):
        picked = [lives[i] for i in rng.integers(len(lives), size=len(lives))]
        p99s[draw] = np.percentile(np.concatenate([rng.choice(run, run.size) for run in picked]), 99)
    low, high = np.percentile(p99s, POOLED_INTERVAL)
    return float(low), float(high)


def report_pooled(rtt_ms: float, kept: Sequence[dict[str, list[ArmRun]]]) -> None:
    """Prints, per arm, the TTFT quantiles over the requests of every run in `kept` (runs kept in several workdirs,
    each with its turns) against the simulator's over every replay of each of those runs, each fitted on its own turn
    and priced at its arm's own speed (`arm_speed_scale`), as `report_sim`'s headline (which leaves out runs whose
    servers did not count their CPU). One run's P99 of 79 requests is about its longest wait, and one run's machine
    and lottery move it; over several runs' requests the P99 stands on some of their tens of longest waits, and says
    whether the simulator's tail is the live one's or only met it by chance. Beside it, how far the live P99 moves
    over other draws of the same runs and requests (`pooled_p99_interval`), and whether the simulator's lies there."""
    print(f"\nRTT {rtt_ms:g} ms, pooled over {len(kept)} kept runs' requests (every turn; the simulator: each run at "
          f"its arm's own speed, {SIM_REPLAYS} replays each), TTFT P{' / P'.join(map(str, POOLED_QUANTILES))}:")
    within, compared = 0, 0
    for arm in SIMULATED_ARMS:
        lives, sims = [], []
        for runs in kept:
            fits = [turn_fit(runs, turn) for turn in range(len(runs["no drop"]))]
            for (base, exchanged), run in zip(fits, runs.get(arm, []), strict=False):
                scale = arm_speed_scale(base, run)
                if not run.served or scale is None:  # as the headline: runs whose servers did not count CPU are left
                    continue
                lives.append(run.ttft())
                sims.extend(sim_ttfts(base, rtt_ms, arm, exchanged, cost_scale=scale))
        if not lives:
            continue
        live, sim = np.concatenate(lives), np.concatenate(sims)
        sim = sim[np.isfinite(sim)]
        live_q, sim_q = (np.percentile(values, POOLED_QUANTILES) for values in (live, sim))
        off = off_by(float(live_q[-1]), float(sim_q[-1]))
        within, compared = within + (off <= TARGET_SIM), compared + 1
        low, high = pooled_p99_interval(lives)
        print(f"  {arm:<26} {len(lives)} runs, {live.size} requests: live {' / '.join(f'{q:.2f}' for q in live_q)} s, "
              f"sim {' / '.join(f'{q:.2f}' for q in sim_q)} s; P99 off by {off:.0%}: "
              f"{'within' if off <= TARGET_SIM else 'NOT within'} {TARGET_SIM:.0%}; the live P99 drawn again "
              f"{low:.2f}-{high:.2f} s ({POOLED_INTERVAL[0]}-{POOLED_INTERVAL[1]}%), the simulator's "
              f"{'inside' if low <= sim_q[-1] <= high else 'outside'}")
    print(f"  {within} of {compared} arms' pooled P99 within {TARGET_SIM:.0%}")


def same_arrivals(runs: Sequence[ArmRun]) -> bool:
    """Gives whether `runs` replayed the same requests (arrival, prompt and output tokens of every id): turns whose
    burst `--rate` and `--kv-pages-per-block` fixed."""
    replayed = [{i: (r["at_s"], r["prompt_tokens"], r["output_tokens"]) for i, r in run.requests.items()}
                for run in runs]
    return len(replayed) > 1 and all(other == replayed[0] for other in replayed[1:])


def report_live_spread(runs: dict[str, list[ArmRun]]) -> None:
    """Prints, where every turn replayed the same requests, how far each arm's live P99 TTFT lies from the median of
    that arm's runs (as `sim_line` measures the simulator: over the live run): a simulator that gave each arm exactly
    its live median would be within the target on as many runs as this counts: what knowing the workload alone
    reaches, where the simulator also knows each turn's machine (its fit)."""
    turns = max((len(repeats) for repeats in runs.values()), default=0)
    if turns < 2 or not same_arrivals([run for repeats in runs.values() for run in repeats]):
        return
    print(f"  the live runs against their arm's median (every turn replayed the same requests; a simulator that gave "
          f"each arm its live median would be within {TARGET_SIM:.0%} of as many):")
    within, compared = 0, 0
    for arm in SIMULATED_ARMS:
        p99s = [pct(run.ttft(), 99) for run in runs.get(arm, []) if run.served]
        if len(p99s) < 2:
            continue
        middle = statistics.median(p99s)
        offs = [off_by(p99, middle) for p99 in p99s]
        within, compared = within + sum(off <= TARGET_SIM for off in offs), compared + len(offs)
        print(f"    {arm:<26} median {middle:6.2f} s; " + ", ".join(
            f"{p99:.2f} s off by {off:.0%}" for p99, off in zip(p99s, offs, strict=True)))
    print(f"    {within} of {compared} runs within {TARGET_SIM:.0%} of their arm's median")


def report_sensitivity(rtt_ms: float, runs: dict[str, list[ArmRun]],
                       fits: list[tuple[ArmRun, list[ArmRun]]], slices: Sequence[float | None]) -> None:
    """Prints how far the simulated P99 TTFT moves when every CPU cost (`scaled_costs`) is `SENSITIVITY` lower or
    higher (the arrivals as recorded): how closely the simulator must know this machine's speed for its P99 to be
    within the target, against how far that speed moves between arms (`ArmRun.batch_cpu`)."""
    print(f"  the simulated P99 with every CPU cost {SENSITIVITY:.0%} lower | as fitted | {SENSITIVITY:.0%} higher "
          "(the arrivals as recorded), by turn:")
    for arm in SIMULATED_ARMS:
        if not runs.get(arm):
            continue
        cells = []
        for (base, exchanged), member_scale in zip(fits[:len(runs[arm])], slices, strict=False):
            low, fitted, high = (sim_p99_ttft(base, rtt_ms, arm, exchanged, member_scale, cost_scale=scale,
                                              replays=1)[0]
                                 for scale in (1 - SENSITIVITY, 1.0, 1 + SENSITIVITY))
            moved = max(abs(low - fitted), abs(high - fitted)) / fitted
            cells.append(f"{low:6.2f} | {fitted:6.2f} | {high:6.2f} s (moves {moved:.0%})")
        print(f"    {arm:<26} " + "; ".join(cells))


def tries_text(config: KunServeSimConfig) -> str:
    """Gives how the report says a client's try is simulated."""
    return (f"a client's try {config.lookup_s * 1000:.0f} ms for a DHT lookup (none within "
            f"{config.records_max_age_s:g} s) and {config.open_s * 1000:.0f} ms an open per server")


def report_untracked(runs: dict[str, list[ArmRun]]) -> None:
    """Prints, per run that sampled its processes, what those outside the simulator spent (`ArmRun.untracked_cpu`):
    a token through one whole server, one through a group's members, and a refused round. The simulator takes the
    no-drop run's figures and prices a group's token as a whole server's (`KunServeSimConfig.token_cpu_ms`); the arms
    that pipelined show how far that holds."""
    lines = []
    for arm in ARMS:
        for turn, run in enumerate(runs.get(arm, [])):
            fit = run.untracked_cpu()
            if fit is None:
                continue
            lines.append(f"    {arm + (f' #{turn + 1}' if turn else ''):<32} {shown(fit.token_ms):>9} "
                         f"{shown(fit.piped_token_ms):>9} {shown(fit.refused_round_ms):>9}  ({fit.intervals} s)")
    if lines:
        print("  CPU outside the simulator's processes (p2pd, fabric, DHT nodes), fitted per run: a token through one "
              "whole server, through a group, a refused round:")
        print(f"    {'':<32} {'token':>9} {'via group':>9} {'refused':>9}")
        print("\n".join(lines))


def shown(ms: float | None) -> str:
    return "-" if ms is None else f"{ms:.1f} ms"


def off_by(live: float, other: float) -> float:
    """Gives how far `other` (a simulated or typical P99 TTFT) is from the `live` one, over the live one."""
    return abs(other - live) / live if live else math.nan


def sim_line(name: str, live: float, sim: float, band: tuple[float, float] | None = None) -> bool:
    """Prints how far the simulated P99 TTFT `sim` is from the `live` one (and whether `live` is inside the replays'
    10-90% `band`); gives whether it is within the target."""
    off = off_by(live, sim)
    spread = inside = ""
    if band is not None:
        spread = f" ({band[0]:.2f}-{band[1]:.2f})"
        inside = f"; live {'inside' if band[0] <= live <= band[1] else 'outside'} the replays' 10-90%"
    print(f"  {name:<38} live {live:7.2f} s  sim {sim:7.2f} s{spread}  off by {off:.0%}: "
          f"{'within' if off <= TARGET_SIM else 'NOT within'} {TARGET_SIM:.0%}{inside}")
    return off <= TARGET_SIM


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rtt", type=float, nargs="+", default=[20.0, 40.0])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=ARMS)
    parser.add_argument("--start", type=float, default=700.0, help="trace seconds")
    parser.add_argument("--end", type=float, default=900.0)
    parser.add_argument("--thin", type=int, default=8, help="replay every n-th request of the window")
    parser.add_argument("--rate", type=float,
                        help="mean arrivals per second (default: sized to this machine by a calibration run)")
    parser.add_argument("--prompt-scale", type=float, default=8.0)
    parser.add_argument("--kv-pages-per-block", type=int,
                        help="KV pages of each server's pool per block beside its parameters, a session's each "
                             "(default: sized to the burst by the calibration run)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run the arms this many turns per RTT, each sized by its own calibration run (unless "
                             "--rate and --kv-pages-per-block fix it); the simulator is fitted on each turn and held "
                             "against each run, and against the median of each arm's live P99 TTFT; turns on the "
                             "same requests (--rate and --kv-pages-per-block given) also show how far the live runs "
                             "spread around that median")
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--workdir", type=Path, nargs="+",
                        help="keep every arm's logs, polls and results here; with --report-only, one or more kept runs")
    parser.add_argument("--report-only", action="store_true",
                        help="run nothing: report the runs kept in --workdir again (e.g. with a changed simulator); "
                             "with more than one, also each arm's TTFT over all their requests, live and simulated")
    args = parser.parse_args(argv)
    args.arms = ["no drop", *(arm for arm in args.arms if arm != "no drop")]  # the reference of every ratio
    if args.report_only:
        if args.workdir is None:
            parser.error("--report-only needs --workdir")
        for rtt_ms in args.rtt:
            roots = [root for root in args.workdir if arm_dir(root, rtt_ms, "no drop").is_dir()]
            if not roots:
                print(f"no run kept at RTT {rtt_ms:g} ms")
            kept = [{arm: kept_repeats(root, rtt_ms, arm) for arm in args.arms} for root in roots]
            missing = [str(run.workdir) for runs in kept for repeats in runs.values() for run in repeats
                       if not run.requests]
            if missing:
                parser.error(f"no requests.json in {', '.join(missing)}")
            for root, runs in zip(roots, kept, strict=True):
                if len(roots) > 1:
                    print(f"\n{root}:")
                report(rtt_ms, runs)
            if len(kept) > 1:
                report_pooled(rtt_ms, kept)
        return 0
    if args.workdir is not None and len(args.workdir) > 1:
        parser.error("a live run keeps its files in one --workdir")
    workdir = args.workdir[0] if args.workdir is not None else None
    if os.geteuid() != 0:
        print("needs root: network namespaces", file=sys.stderr)
        return 2
    count = len(burst_requests(args, 1.0))
    print(f"KunServe live: {count} requests (every {args.thin}th of the code trace's {args.start:g}-{args.end:g} s); "
          f"{datetime.date.today()} on {platform.node()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="kunserve-burst-") as tmp:
        root = workdir or Path(tmp)
        for rtt_ms in args.rtt:
            runs: dict[str, list[ArmRun]] = {arm: [] for arm in args.arms}
            root.mkdir(parents=True, exist_ok=True)
            (root / ROOM_NAMED_FILE).touch()  # what this run's servers and clients do (`run_marked`, `kept_window`)
            (root / WAITS_WITHDRAWN_FILE).touch()
            (root / CHUNKS_PASSED_FILE).touch()
            (root / ROOM_KEPT_FILE).write_text(json.dumps({"lead_s": NAMED_ROOM_LEAD_S, "grace_s": NAMED_ROOM_GRACE_S}))
            extra = link_crossing_extra(root, rtt_ms, measure=True)
            print("a prompt's message beyond its bytes at the link's rate: " + ", ".join(
                f"{size // (hidden_size() * WIRE_BYTES)} tokens {seconds * 1000:.0f} ms" for size, seconds in extra),
                flush=True)
            for turn in range(args.repeats):  # in turns, so that the machine's drift reaches every arm alike
                rate, pool = sized_burst(args, rtt_ms, arm_dir(root, rtt_ms, "calibration", turn))
                requests = burst_requests(args, rate)
                for arm in args.arms:
                    runs[arm].append(run_arm(arm, rtt_ms, requests, pool, args, arm_dir(root, rtt_ms, arm, turn),
                                             label=arm + (f" #{turn + 1}" if turn else "")))
            report(rtt_ms, runs)
    return 0


def sized_burst(args: argparse.Namespace, rtt_ms: float, workdir: Path) -> tuple[float, int]:
    """Gives the mean arrival rate and the pools' KV pages per block of a turn: `--rate` and `--kv-pages-per-block`
    where given, else sized to the machine as it runs now by a calibration run at `rtt_ms` (kept in `workdir`): this
    VM's speed moved 10-40% between turns an hour apart (r17), and a burst sized once left later turns too light."""
    rate, pool = args.rate, args.kv_pages_per_block
    if rate is None or pool is None:
        calibration = calibrate(rtt_ms, args, workdir)
        speeds = calibration.speeds
        print(f"calibration: the no-drop swarm loaded with {CALIBRATION_REQUESTS} requests, one every "
              f"{CALIBRATION_GAP_S:g} s: a prompt token took {speeds.prompt_token_ms:.2f} ms and a decode step "
              f"{speeds.output_token_ms:.1f} ms of a loaded server's compute; a session's TTFT "
              f"{calibration.ttft_s:.2f} s and TBT {calibration.tbt_s * 1000:.0f} ms (medians)", flush=True)
        if rate is None:
            rate = sized_rate(args, speeds)
            print(f"mean {rate:g}/s, sized: the busiest {BUSIEST_S:g} s of arrivals ask {COMPUTE_SHARE:.0%} of "
                  f"both servers' compute", flush=True)
        if pool is None:
            pool = sized_pool(burst_requests(args, rate), calibration)
            peak = peak_sessions(burst_requests(args, rate), calibration)
            print(f"pools of {pool} KV pages per block ({pool + calibration.spare_sessions} sessions of 30 blocks "
                  f"per server), sized: the busiest moment asks {peak} sessions (arrivals at the calibrated TTFT "
                  f"and TBT, none waiting), {KV_OVERLOAD:g}x what the two servers hold undropped or more",
                  flush=True)
    if args.rate is not None:
        print(f"mean {rate:g}/s (--rate)", flush=True)
    if args.kv_pages_per_block is not None:
        print(f"pools of {pool} KV pages per block (--kv-pages-per-block)", flush=True)
    return rate, pool


if __name__ == "__main__":
    sys.exit(main())
