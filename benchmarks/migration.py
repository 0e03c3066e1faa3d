"""Live migration on the emulated WAN: a session's first span moves between two servers that host the same blocks,
by KV transfer, by replay and by the mode the source server picks itself ("auto", `choose_mode`), side by side.

The swarm: the default SmolLM2-135M-Instruct, servers `a` and `b` hosting blocks 0:10 and `tail` hosting 10:30, the
DHT, a client and a second client (`bg`), each in a network namespace; every pair at one RTT (20 and 80 ms, changed
at run time) and every host's access link limited to each of `--mbit` (100 Mbit/s, the issue's setting, and 400
Mbit/s, where a KV transfer can beat a replay on these CPUs) each way. For each RTT, session size
(100, 500 and 2,000 tokens of this repository's README, from an offset that changes with the repeat) and repeat,
one session per mode is prefilled on the source, decodes 2 tokens, moves to
the other server (timed by the client: from the `migrate` call until the session is ready there, the client's
switch included) and decodes 2 more; the direction alternates. Meanwhile `bg` decodes another session on the
source, one token after the other: its worst gap between tokens during the move, less its median gap before, is the
stall the move caused to the source's other sessions.

Printed: per setting, the measured seconds of each mode, which was faster, what "auto" took and the seconds it
expected of each mode (RTT timed on an `info` call; bandwidth from earlier transfers to that peer, else the
servers' measured inbound throughput, else 100 Mbit/s; prefill speed from the destination's record); how often
"auto" picked the mode that measured faster (target >= 90%); greedy tokens after each move against the same
session without a move.

    .venv/bin/python benchmarks/migration.py [--rtts 20,80] [--sizes 100,500,2000] [--repeats 1] [--mbit 100,400]

Needs root (network namespaces). Never asserts.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from netem import netns
from netem.network import EmulatedNetwork
from netem.processes import HostProcess
from netem.topology import constant
from swarm.local_swarm import SwarmProcesses, threads_per_server
from swarm.model import DEFAULT_MODEL

HOSTS = ("dht", "client", "bg", "a", "b", "tail")
SERVERS = {"a": "0:10", "b": "0:10", "tail": "10:30"}
MODES = ("kv", "replay", "auto")
TARGET_RIGHT_CHOICES = 0.9
CLIENT_TIMEOUT_S = 600.0
BG_PROMPT_TOKENS = 16
BASELINE_S = 1.5  # the background session decodes this long before each move, for its usual gap


@dataclass
class Move:
    mode: str
    taken: str
    seconds: float
    expected_s: dict[str, float]
    stall_ms: float
    tokens_match: bool


@dataclass
class Setting:
    mbit: float
    rtt_ms: float
    tokens: int
    repeat: int
    moves: dict[str, Move] = field(default_factory=dict)

    def faster(self) -> str:
        return "kv" if self.moves["kv"].seconds <= self.moves["replay"].seconds else "replay"

    def right(self) -> bool:
        return self.moves["auto"].taken == self.faster()

    def margin(self) -> float:
        """Gives how much slower the slower mode measured, as a share of the faster."""
        kv, replay = self.moves["kv"].seconds, self.moves["replay"].seconds
        return abs(kv - replay) / min(kv, replay)


def stall_ms(stamps: list[float], started_at: float, ended_at: float) -> float:
    """Gives the worst gap between the background session's tokens that overlaps the move, less its median gap
    before the move (0 if it decoded no token around the move)."""
    gaps = list(itertools.pairwise(stamps))
    before = [later - earlier for earlier, later in gaps if later <= started_at]
    during = [later - earlier for earlier, later in gaps if later > started_at and earlier < ended_at]
    if not before or not during:
        return 0.0
    return max(0.0, (max(during) - statistics.median(before)) * 1000)


def spawn_client(network: EmulatedNetwork, host: str, swarm: SwarmProcesses, workdir: Path) -> HostProcess:
    client = network.spawn(host, [sys.executable, "-m", "tests.netem_client", "--model", DEFAULT_MODEL,
                                  "--initial-peers", *swarm.initial_peers], name=host, log_dir=workdir,
                           interactive=True, env={"OMP_WAIT_POLICY": "PASSIVE"})
    client.read_line(CLIENT_TIMEOUT_S)
    return client


def measure(args: argparse.Namespace, workdir: Path) -> list[Setting]:
    settings: list[Setting] = []
    with EmulatedNetwork(constant(HOSTS, args.rtts[0], mbit=args.mbit[0]), run_id=f"mig{os.getpid()}") as network, \
            SwarmProcesses(workdir, announce_period_s=5.0, record_ttl_s=30.0,
                           torch_threads=threads_per_server(len(SERVERS))) as swarm:
        swarm.start_dht(host=network.address("dht"), launcher=network.command("dht", []))
        procs = {host: swarm.start_server(DEFAULT_MODEL, blocks, wait=False, name=host, host=network.address(host),
                                          launcher=network.command(host, [])) for host, blocks in SERVERS.items()}
        for proc in procs.values():
            swarm.wait_ready(proc)
        client, bg = spawn_client(network, "client", swarm, workdir), spawn_client(network, "bg", swarm, workdir)
        peers = [procs["a"].peer_id, procs["b"].peer_id]
        try:
            warm = client.request({"op": "move", "prompt_tokens": 16, "mode": "kv", "from": peers[0], "to": peers[1]},
                                  CLIENT_TIMEOUT_S)
            if "error" in warm:
                raise RuntimeError(warm["error"])
            direction = 0
            for repeat, mbit, rtt_ms in itertools.product(range(args.repeats), args.mbit, args.rtts):
                network.set_topology(constant(HOSTS, rtt_ms, mbit=mbit))
                for tokens in args.sizes:
                    setting = Setting(mbit, rtt_ms, tokens, repeat)
                    for mode in MODES:
                        source, destination = peers[direction], peers[1 - direction]
                        direction = 1 - direction
                        setting.moves[mode] = move_once(client, bg, mode, tokens, source, destination, repeat)
                        done = setting.moves[mode]
                        match = "match" if done.tokens_match else "DIFFER"
                        print(f"  {mbit:g} Mbit/s, RTT {rtt_ms:g} ms, {tokens} tokens, {mode}: {done.taken} in "
                              f"{done.seconds:.3f} s, stall {done.stall_ms:.0f} ms, tokens {match}", flush=True)
                    settings.append(setting)
        finally:
            for process in (client, bg):
                process.stop()
    return settings


def prompt_ids(tokens: int, repeat: int) -> list[list[int]]:
    """Gives `tokens` tokens of natural text (this repository's README, repeated as needed), from an offset that
    changes with `repeat`: greedy decoding of text has clear winners, where random tokens bring near ties that the
    order of floating-point sums in a batch can flip."""
    from transformers import AutoTokenizer

    from swarm.model import resolve_model

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    ids = AutoTokenizer.from_pretrained(resolve_model(DEFAULT_MODEL).path)(text)["input_ids"]
    offset = 97 * repeat
    while len(ids) < offset + tokens:
        ids = ids + ids
    return [ids[offset : offset + tokens]]


def move_once(client: HostProcess, bg: HostProcess, mode: str, tokens: int, source: str, destination: str,
              repeat: int) -> Move:
    started = bg.request({"op": "decode_on", "peer_id": source, "prompt_tokens": BG_PROMPT_TOKENS}, CLIENT_TIMEOUT_S)
    if "error" in started:
        raise RuntimeError(started["error"])
    time.sleep(BASELINE_S)
    reply = client.request({"op": "move", "input_ids": prompt_ids(tokens, repeat), "mode": mode, "from": source,
                            "to": destination}, CLIENT_TIMEOUT_S)
    stamps = bg.request({"op": "decode_stop"}, CLIENT_TIMEOUT_S)
    if "error" in reply or "error" in stamps:
        raise RuntimeError(reply.get("error") or stamps.get("error"))
    stall = stall_ms(stamps["stamps"], reply["started_at"], reply["ended_at"])
    return Move(mode, reply["reply"]["mode"], reply["move_s"], reply["reply"].get("expected_s", {}), stall,
                reply["tokens"] == reply["expected"])


def report(settings: list[Setting], args: argparse.Namespace) -> None:
    print("\n## Moving a session's first span (blocks 0:10 of SmolLM2-135M-Instruct): seconds by mode\n")
    print("| Mbit/s | RTT ms | tokens | repeat | KV s | replay s | faster | auto took | auto s "
          "| auto expected KV s / replay s | right | slower by | stall ms KV / replay / auto | tokens match |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for s in settings:
        auto = s.moves["auto"]
        expected = auto.expected_s
        print(f"| {s.mbit:g} | {s.rtt_ms:g} | {s.tokens} | {s.repeat + 1} | {s.moves['kv'].seconds:.3f} | "
              f"{s.moves['replay'].seconds:.3f} | {s.faster()} | {auto.taken} | {auto.seconds:.3f} | "
              f"{expected.get('kv', float('nan')):.3f} / {expected.get('replay', float('nan')):.3f} | "
              f"{'yes' if s.right() else 'no'} | {100 * s.margin():.0f}% | "
              f"{s.moves['kv'].stall_ms:.0f} / {s.moves['replay'].stall_ms:.0f} / {auto.stall_ms:.0f} | "
              f"{'yes' if all(m.tokens_match for m in s.moves.values()) else 'NO'} |")
    right = sum(s.right() for s in settings) / len(settings)
    clear = [s for s in settings if s.margin() > 0.1]
    clear_right = sum(s.right() for s in clear) / len(clear) if clear else float("nan")
    print(f"\nauto picked the faster mode in {right:.0%} of {len(settings)} settings "
          f"({clear_right:.0%} of the {len(clear)} where the modes differ by more than 10%)")
    verdict = "PASS" if right >= TARGET_RIGHT_CHOICES else "FAIL"
    print(f"verdict: {verdict}: split_migrations (choose_mode) picks the faster mode in >= "
          f"{TARGET_RIGHT_CHOICES:.0%} of moves: measured {right:.0%}")
    matched = all(m.tokens_match for s in settings for m in s.moves.values())
    print(f"greedy tokens after every move equal those of the same session without a move: "
          f"{'yes' if matched else 'NO'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rtts", default="20,80", type=lambda text: [float(x) for x in text.split(",")])
    parser.add_argument("--sizes", default="100,500,2000", type=lambda text: [int(x) for x in text.split(",")])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--mbit", default="100,400", type=lambda text: [float(x) for x in text.split(",")],
                        help="every host's access link, each way (Mbit/s), one setting each")
    args = parser.parse_args(argv)
    problem = netns.support_problem()
    if problem:
        print(f"cannot run: {problem}")
        return 2
    print(f"# chainswarm migration benchmark, {datetime.datetime.now().isoformat(timespec='seconds')}")
    print(f"machine: {platform.platform()}, cpu_count={os.cpu_count()}, python {platform.python_version()}; "
          f"loadavg {os.getloadavg()}; links {args.mbit} Mbit/s; RTTs {args.rtts} ms; sizes {args.sizes}",
          flush=True)
    with tempfile.TemporaryDirectory(prefix="migration-bench-") as tmp:
        settings = measure(args, Path(tmp))
    report(settings, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
