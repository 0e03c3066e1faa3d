"""A soak under faults: a 3-stage swarm of SmolLM2-135M with 2 servers per stage on loopback, `--sessions`
concurrent sessions of mixed lengths from `--clients` client processes for `--duration` seconds, while every
`--chaos-period` seconds a random server is killed with SIGKILL and restarted, and every other period a random
client process is killed mid-generation and restarted.

Each client process (`--worker`) runs its share of the sessions in threads, one after the other in each thread:
a random prompt (16-256 tokens), 8-48 new greedy tokens, its token times stamped. After the run, the local Hugging
Face model generates every finished session's prompt alone, greedy, and its tokens are compared.

Printed: sessions started, finished and exact (of clients that were not killed: every one must be), the failures
by error, failovers, the servers' KV pages in use at the end (every session closed: must be 0) against their
baseline, the servers' RSS, and P50/P99 time per token after the first.

RSS is counted outside the page pool, which the OS commits page by page as KV is first written (up to the budget, by
design); a leak would show in the rest. The target (under 5% growth over the run) is judged where load cannot move
it: once the run is over and every session closed, each server alive at the end is read idle beside a reference
server of its stage, one that joined the swarm only for the run's last 90 s (one minute of serving, after it loaded):
a server as it stands after its warm-up, which has touched the code and state that serving needs once. The
difference is what more time serving added. Under load, RSS follows the sessions a server holds (the malloc heap moves
by tens of MiB either way), so the samples taken every 2 s during the run, split into heap, other anonymous memory
and files, are reported beside it: the median of a process's first 30 s after its first minute against its last
30 s, and the trend (Theil-Sen slope, per 10 minutes).

    .venv/bin/python benchmarks/soak.py [--duration 600] [--sessions 64] [--clients 4] [--chaos-period 30]

Loopback only. Never asserts.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import torch
from transformers import AutoModelForCausalLM

from client import ClientConfig, DistributedModelForCausalLM, SwarmClient
from client.timing import StepClock
from server.allocator import TRIM_PERIOD_S
from swarm.local_swarm import Proc, SwarmProcesses
from swarm.model import DEFAULT_MODEL, resolve_model
from swarm.records import ServerRecord

STAGES = ("0:10", "10:20", "20:30")
SERVERS_PER_STAGE = 2
PROMPT_TOKENS = (16, 256)
NEW_TOKENS = (8, 48)
RSS_GROWTH_TARGET = 0.05
WARMUP_S = 60.0  # a server's RSS is compared from this age on: its first minute loads the model and fills the pool
RSS_SAMPLE_S = 2.0
RSS_WINDOW_S = 30.0  # the medians compared: a process's first and last this many seconds after its warm-up
RSS_PARTS = ("heap", "anon", "file")  # glibc's main heap; other anonymous mappings (jemalloc, arenas, pymalloc); files
REFERENCE_JOIN_S = 90.0  # the reference servers join this long before the run ends: they load, then serve a minute


def worker(args: argparse.Namespace) -> int:
    """Runs `args.sessions` threads of sessions until `args.duration` passes; writes one JSON line per session."""
    model = DistributedModelForCausalLM.from_pretrained(
        DEFAULT_MODEL, initial_peers=args.initial_peers,
        client_config=ClientConfig(request_timeout_s=60.0, busy_wait_s=120.0, route_wait_s=120.0))
    deadline = time.monotonic() + args.duration
    lock = threading.Lock()
    out = args.out.open("a", buffering=1)  # one line per event, visible at once; closed below

    def run(thread: int) -> None:
        rng = random.Random(args.seed * 1000 + thread)
        while time.monotonic() < deadline:
            prompt = [rng.randrange(100, 40_000) for _ in range(rng.randint(*PROMPT_TOKENS))]
            new_tokens = rng.randint(*NEW_TOKENS)
            clock = StepClock()
            row: dict[str, object] = {"worker": args.seed, "prompt": prompt, "new_tokens": new_tokens,
                                      "started_s": time.time()}
            with lock:
                out.write(json.dumps({"event": "started", **row}) + "\n")
            try:
                with model.inference_session(max_length=len(prompt) + new_tokens) as session:
                    output = model.generate(torch.tensor([prompt]), session=session, max_new_tokens=new_tokens,
                                            do_sample=False, streamer=clock)
                    row["failovers"] = session.failovers
                row["tokens"] = output[0, len(prompt):].tolist()
                row["gaps_s"] = [b - a for a, b in zip(clock.stamps_s[1:], clock.stamps_s[2:], strict=False)]
            except Exception as error:  # counted by kind; the thread goes on with its next session
                row["error"] = f"{type(error).__name__}: {error}"[:300]
            with lock:
                out.write(json.dumps({"event": "ended", **row}) + "\n")

    threads = [threading.Thread(target=run, args=(index,), daemon=True) for index in range(args.sessions)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    out.close()
    model.shutdown()
    return 0


def rss_parts(pid: int) -> dict[str, int] | None:
    """Gives the resident KiB of process `pid` outside its page pool, by kind of mapping (`RSS_PARTS`), or None if
    it is gone.

    The pool (`swarm.memory`: one anonymous mapping of the server's whole budget, its largest) is committed page by
    page as KV is first written, so its resident share grows up to the budget without any leak; a leak shows in the
    rest (Python objects, torch's allocations, buffers)."""
    try:
        text = Path(f"/proc/{pid}/smaps").read_text()
    except OSError:
        return None
    mappings: list[tuple[int, int, str]] = []  # (size KiB, rss KiB, part) of each mapping
    size, part = 0, "anon"
    for line in text.splitlines():
        fields = line.split()
        if fields and not fields[0].endswith(":"):  # a mapping's header: range, perms, offset, dev, inode[, path]
            path = fields[5] if len(fields) > 5 else ""
            part = "heap" if path == "[heap]" else "file" if path.startswith("/") else "anon"
        elif fields[:1] == ["Size:"]:
            size = int(fields[1])
        elif fields[:1] == ["Rss:"]:
            mappings.append((size, int(fields[1]), part))
    if not mappings:
        return None
    pool = max(mappings)
    parts = dict.fromkeys(RSS_PARTS, 0)
    for mapping in mappings:
        if mapping is not pool:
            parts[mapping[2]] += mapping[1]
    return parts


@dataclass(frozen=True)
class RssGrowth:
    """One server process's RSS over its life after the warm-up (KiB)."""

    lived_s: float
    first_kb: float  # median over the first RSS_WINDOW_S
    last_kb: float  # median over the last RSS_WINDOW_S
    trend: float  # Theil-Sen slope over the warm samples, as a share of first_kb per 10 minutes
    low_kb: int
    high_kb: int
    part_change_kb: dict[str, float]  # last window's median minus the first's, by part

    @property
    def growth(self) -> float:
        return self.last_kb / self.first_kb - 1


@dataclass(frozen=True)
class IdleServer:
    """A server alive at the end of the run, read once idle."""

    name: str
    stage: str
    lived_s: float
    parts: dict[str, int]  # RSS KiB by part
    steps: int  # the session steps it computed

    @property
    def total_kb(self) -> int:
        return sum(self.parts.values())


def rss_growths(rss: dict[str, list[tuple[float, dict[str, int]]]]) -> dict[str, RssGrowth]:
    """Gives the growth of every process that lived long enough for two windows after its warm-up."""
    growths = {}
    for name, samples in rss.items():
        warm = [(age, parts) for age, parts in samples if age >= WARMUP_S]
        if not warm or warm[-1][0] < WARMUP_S + 2 * RSS_WINDOW_S:
            continue
        first = [parts for age, parts in warm if age < WARMUP_S + RSS_WINDOW_S]
        last = [parts for age, parts in warm if age > warm[-1][0] - RSS_WINDOW_S]
        totals = [(age, sum(parts.values())) for age, parts in warm]
        slopes = [(kb_b - kb_a) / (age_b - age_a) for i, (age_a, kb_a) in enumerate(totals)
                  for age_b, kb_b in totals[i + 1:] if age_b > age_a]
        first_kb = statistics.median(sum(parts.values()) for parts in first)
        growths[name] = RssGrowth(
            warm[-1][0], first_kb, statistics.median(sum(parts.values()) for parts in last),
            statistics.median(slopes) * 600 / first_kb if slopes else 0.0,
            min(kb for _, kb in totals), max(kb for _, kb in totals),
            {part: statistics.median(p[part] for p in last) - statistics.median(p[part] for p in first)
             for part in RSS_PARTS},
        )
    return growths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=600.0)
    parser.add_argument("--sessions", type=int, default=64, help="concurrent sessions over all clients")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--chaos-period", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--initial-peers", nargs="*", default=[], help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    print(f"soak: {args.sessions} sessions from {args.clients} clients for {args.duration:g} s, a server killed every "
          f"{args.chaos_period:g} s and a client every {2 * args.chaos_period:g} s; "
          f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC on {platform.node()} ({os.cpu_count()} cores)",
          flush=True)
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp, SwarmProcesses(Path(tmp), torch_threads=1) as swarm:
        workdir = Path(tmp)
        swarm.start_dht()
        servers: dict[str, Proc] = {}  # slot ("0:10/1") -> its process now
        for stage in STAGES:
            for copy in range(SERVERS_PER_STAGE):
                servers[f"{stage}/{copy}"] = swarm.start_server(DEFAULT_MODEL, stage, wait=False,
                                                                name=f"server-{stage}-{copy}")
        for proc in servers.values():
            swarm.wait_ready(proc)
        per_client = [args.sessions // args.clients + (index < args.sessions % args.clients)
                      for index in range(args.clients)]
        clients: dict[int, tuple[Proc, int]] = {}  # slot -> its process now and that worker's seed
        killed_clients: set[int] = set()  # worker seeds whose process was killed: their sessions do not count
        generation = 0

        def start_client(slot: int, remaining_s: float) -> None:
            nonlocal generation
            generation += 1
            seed = slot * 100 + generation
            command = ["benchmarks/soak.py", "--worker", "--seed", str(seed), "--sessions", str(per_client[slot]),
                       "--duration", str(max(1.0, remaining_s)), "--out", str(workdir / "sessions.jsonl"),
                       "--initial-peers", *swarm.initial_peers]
            clients[slot] = (swarm._spawn(f"client-{slot}-{generation}", command), seed)

        started = time.monotonic()
        for slot in range(args.clients):
            start_client(slot, args.duration)
        born = {slot: started for slot in servers}  # when each slot's process started
        rss: dict[str, list[tuple[float, dict[str, int]]]] = {}  # process name -> (age s, RSS KiB by part)
        chaos: Counter[str] = Counter()
        tick = 0

        def sample() -> None:
            now = time.monotonic()
            for slot, proc in list(servers.items()):
                parts = rss_parts(proc.popen.pid)
                if parts is not None:
                    rss.setdefault(proc.name, []).append((now - born[slot], parts))

        sampling = threading.Event()

        def sample_until_done() -> None:
            while not sampling.wait(RSS_SAMPLE_S):
                sample()

        sampler = threading.Thread(target=sample_until_done, daemon=True)
        sampler.start()
        references: dict[str, Proc] = {}  # stage -> its reference server, once it joined
        born_reference = started + max(0.0, args.duration - REFERENCE_JOIN_S)
        while time.monotonic() - started < args.duration:
            next_tick = started + (tick + 1) * args.chaos_period
            if not references:
                time.sleep(max(0.0, min(next_tick, born_reference) - time.monotonic()))
                if time.monotonic() >= born_reference:
                    references = {stage: swarm.start_server(DEFAULT_MODEL, stage, wait=False, name=f"reference-{stage}")
                                  for stage in STAGES}
                    continue
            time.sleep(max(0.0, min(next_tick, started + args.duration) - time.monotonic()))
            elapsed = time.monotonic() - started
            if elapsed >= args.duration:
                break
            tick += 1
            slot = rng.choice(sorted(servers))
            swarm.kill(servers[slot])
            servers[slot].popen.wait(timeout=30)
            born[slot] = time.monotonic()  # before the new process is in `servers`: the sampler reads both
            servers[slot] = swarm.start_server(DEFAULT_MODEL, slot.split("/")[0], wait=False,
                                               name=f"server-{slot.replace('/', '-')}-{tick}")
            chaos["servers killed"] += 1
            if tick % 2 == 0:
                victim = rng.randrange(args.clients)
                swarm.kill(clients[victim][0])
                clients[victim][0].popen.wait(timeout=30)
                killed_clients.add(clients[victim][1])
                start_client(victim, args.duration - elapsed)
                chaos["clients killed"] += 1
        for proc, _ in clients.values():  # they stop starting sessions at the deadline and finish the ones they run
            proc.popen.wait(timeout=900)
        sampling.set()
        sampler.join()
        time.sleep(5.0)
        client = SwarmClient(resolve_model(DEFAULT_MODEL).model_id, 30, swarm.initial_peers)
        try:
            records = client.run(client.servers())
            pages = {peer: record.pages_kv for peer, record in records.items()}
            steps = client.run(steps_computed(client, list(records.values())))
        finally:
            client.shutdown()
        time.sleep(2 * TRIM_PERIOD_S)  # every server returned its freed memory since its last session (trim or decay)
        ended = time.monotonic()
        processes = [(proc, slot.split("/")[0], born[slot]) for slot, proc in servers.items()]
        processes += [(proc, stage, born_reference) for stage, proc in references.items()]
        idle = [IdleServer(proc.name, stage, ended - since, parts, steps.get(proc.peer_id, 0))
                for proc, stage, since in processes if (parts := rss_parts(proc.popen.pid)) is not None]
        report(workdir / "sessions.jsonl", killed_clients, chaos, pages, rss, idle)
    return 0


async def steps_computed(client: SwarmClient, records: list[ServerRecord]) -> dict[str, int]:
    """Gives the session steps each server computed, by peer id (from its `info`)."""
    steps = {}
    for record in records:
        connection = await client.connect(record)
        try:
            info = await connection.call("info", {}, timeout=10.0)
        finally:
            await connection.close()
        steps[record.peer_id] = sum(info["steps_computed"].values())
    return steps


def report(path: Path, killed: set[int], chaos: Counter[str], pages: dict[str, int],
           rss: dict[str, list[tuple[float, dict[str, int]]]], idle: list[IdleServer]) -> None:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    started = [row for row in rows if row["event"] == "started"]
    ended = [row for row in rows if row["event"] == "ended"]
    live = [row for row in ended if row["worker"] not in killed]
    finished = [row for row in live if "tokens" in row]
    errors = Counter(row["error"].split(":")[0] for row in live if "error" in row)
    local = AutoModelForCausalLM.from_pretrained(resolve_model(DEFAULT_MODEL).path, dtype=torch.float32).eval()
    exact = 0
    for row in finished:
        prompt = torch.tensor([row["prompt"]])
        expected = local.generate(prompt, max_new_tokens=row["new_tokens"], do_sample=False)
        exact += expected[0, prompt.shape[1]:].tolist() == row["tokens"]
    gaps = sorted(gap for row in finished for gap in row["gaps_s"])
    killed_sessions = sum(1 for row in started if row["worker"] in killed) - sum(
        1 for row in ended if row["worker"] in killed)
    print(f"\nchaos: {dict(chaos)}")
    print("| sessions started | ended (live clients) | finished | exact | failed | in killed clients, cut off | "
          "failovers |\n|---|---|---|---|---|---|---|")
    print(f"| {len(started)} | {len(live)} | {len(finished)} | {exact} | {len(live) - len(finished)} "
          f"| {killed_sessions} | {sum(row.get('failovers', 0) for row in finished)} |")
    print(f"failures by error: {dict(errors)}")
    for kind in errors:  # one message of each kind: which call timed out, on what
        print(f"  e.g. {next(row['error'] for row in live if row.get('error', '').startswith(kind))}")
    print(f"per-token latency after the first: P50 {statistics.median(gaps) * 1000:.0f} ms, "
          f"P99 {gaps[int(0.99 * (len(gaps) - 1))] * 1000:.0f} ms over {len(gaps)} tokens" if gaps else "no tokens")
    held = sum(pages.values())
    print(f"KV pages held at the end, every session closed: {held} over {len(pages)} servers (baseline 0)")
    growths = rss_growths(rss)
    print(f"RSS outside the pool, sampled every {RSS_SAMPLE_S:g} s; growth: the median of the last {RSS_WINDOW_S:g} s "
          f"over the median of the first {RSS_WINDOW_S:g} s after {WARMUP_S:g} s of age")
    print("| server process | lived s | first MiB | last MiB | growth | trend per 10 min | samples min / max MiB "
          f"| change MiB: {' / '.join(RSS_PARTS)} |")
    print("|---|---|---|---|---|---|---|---|")
    for name, growth in sorted(growths.items()):
        print(f"| {name} | {growth.lived_s:.0f} | {growth.first_kb / 1024:.1f} | {growth.last_kb / 1024:.1f} "
              f"| {growth.growth:+.1%} | {growth.trend:+.1%} "
              f"| {growth.low_kb / 1024:.1f} / {growth.high_kb / 1024:.1f} "
              f"| {' / '.join(f'{growth.part_change_kb[part] / 1024:+.1f}' for part in RSS_PARTS)} |")
    if not growths:
        print(f"no server lived {WARMUP_S + 2 * RSS_WINDOW_S:g} s: no RSS growth to report")
    within = sum(growth.growth < RSS_GROWTH_TARGET for growth in growths.values())
    print(f"under load: {within} of {len(growths)} processes within {RSS_GROWTH_TARGET:.0%}; the heap follows the "
          "sessions a server holds, so this compares loads as much as it finds leaks")
    # What a leak leaves stays when the load has gone: every server alive at the end, idle, against a reference
    # server of its stage that served only the run's last minute, idle beside it
    reference = {server.stage: server for server in idle if server.name.startswith("reference-")}
    print(f"the servers alive at the end, idle (every session closed, freed memory returned since), against a server "
          f"of the same stage that joined {REFERENCE_JOIN_S:g} s before the end (after its warm-up):")
    print("| server process | lived s | steps computed | idle MiB | reference MiB (its steps) | growth | "
          f"idle - reference MiB: {' / '.join(RSS_PARTS)} |\n|---|---|---|---|---|---|---|")
    grown: list[str] = []
    served = [server for server in idle if not server.name.startswith("reference-")]
    for server in sorted(served, key=lambda server: server.name):
        base = reference.get(server.stage)
        if base is None or base.steps == 0:  # gone, or it never served: not a server after its warm-up
            print(f"| {server.name} | {server.lived_s:.0f} | {server.steps} | {server.total_kb / 1024:.1f} "
                  f"| {'gone' if base is None else 'served nothing'} | | |")
            grown.append(server.name)
            continue
        growth = server.total_kb / base.total_kb - 1
        by_part = " / ".join(f"{(server.parts[part] - base.parts[part]) / 1024:+.1f}" for part in RSS_PARTS)
        print(f"| {server.name} | {server.lived_s:.0f} | {server.steps} | {server.total_kb / 1024:.1f} | "
              f"{base.total_kb / 1024:.1f} ({base.steps}) | {growth:+.2%} | {by_part} |")
        if growth >= RSS_GROWTH_TARGET:
            grown.append(server.name)
    print(f"verdict: {'PASS' if served and not grown else 'FAIL'}: RSS of every server alive at the end, idle, "
          f"within {RSS_GROWTH_TARGET:.0%} of its stage's reference after warm-up ({len(served) - len(grown)} of "
          f"{len(served)})" + (f" (not: {', '.join(grown)})" if grown else ""))
    verdict = exact == len(finished) == len(live) and held == 0
    print(f"verdict: {'PASS' if verdict else 'FAIL'}: every session of a live client finished with exact tokens "
          f"({exact}/{len(live)}), no KV page held at the end ({held})")


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    sys.exit(main())
