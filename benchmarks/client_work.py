"""What the client process's own work costs per LM head pass and per token, in CPU milliseconds.

    python benchmarks/client_work.py [--sessions 8] [--tokens 24]

A swarm client runs every session of its process in one Python process: each token's hidden state comes back over
an RPC, goes through the LM head in one pass with the other sessions' rows on the same chain
(`client.batched_head`), is sampled, embedded and sent on. That work follows itself there, so under load tokens
queue in the client. `kunserve_burst.py`'s simulator serializes it (`KunServeSimConfig.client_pass_ms` and
`client_token_ms`) and counts the rest of a token's time beyond the servers' compute as delay.

The rig, on loopback: the DHT and one server of every block with the flags the caller gives (kunserve_burst: its
no-drop arm's, with room for every session); this process opens sessions, generates `--tokens` greedy tokens in
each from threads started together, and reads the CPU time of the client's own processes (this one and its
children that are not the swarm's: its DHT node and their p2pd daemons) over the generation, with one session
(a pass a token) and with `--sessions` (their tokens share passes). The CPU is passes x a pass's cost + tokens x a
token's; the two readings (each the median of `ROUNDS` rounds) give both.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from client.model import DistributedModelForCausalLM
from client.swarm_client import ClientConfig
from swarm.local_swarm import SwarmProcesses
from swarm.model import DEFAULT_MODEL

ROUNDS = 3  # generations timed one after the other per session count; the median's reading is kept
PROMPT_TOKENS = 4  # short prompts: the window is nearly all decode steps


@dataclass(frozen=True)
class ClientWork:
    """The rig's reading: the client's CPU per head pass and per token (ms), and the rounds it was taken from."""

    pass_ms: float
    token_ms: float
    lone: Round  # the median round with one session
    shared: Round  # and with `sessions`
    sessions: int


@dataclass(frozen=True)
class Round:
    """One timed generation: the client's CPU over it (ms), the tokens and the head passes in it."""

    cpu_ms: float
    tokens: int
    passes: int


def _client_cpu_s(swarm_pids: set[int]) -> float:
    """Gives the CPU seconds this process and its descendants outside the swarm's processes have used so far."""
    root = psutil.Process()
    total = 0.0
    for child in root.children():
        if child.pid in swarm_pids:
            continue
        for each in (child, *child.children(recursive=True)):
            try:
                times = each.cpu_times()
            except psutil.Error:  # exited between listing and reading
                continue
            total += times.user + times.system
    times = root.cpu_times()
    return total + times.user + times.system


def _generate_round(model: DistributedModelForCausalLM, sessions: int, tokens: int, max_length: int, seed: int,
                    swarm_pids: set[int]) -> Round:
    """Opens `sessions` sessions, generates `tokens` in each from threads started together, and gives the client's
    CPU over the generation (ms), the tokens and the head passes in it."""
    opened = [model.inference_session(max_length=max_length) for _ in range(sessions)]
    prompts = [torch.randint(3, model.config.vocab_size, (1, PROMPT_TOKENS),
                             generator=torch.Generator().manual_seed(seed + n)) for n in range(sessions)]
    start = threading.Barrier(sessions + 1)
    failures: list[BaseException] = []

    def generate(n: int) -> None:
        start.wait()
        try:
            model.generate(prompts[n], session=opened[n], max_new_tokens=tokens, min_new_tokens=tokens,
                           do_sample=False)
        except BaseException as error:  # reported below: a broken round measures nothing
            failures.append(error)

    threads = [threading.Thread(target=generate, args=(n,), daemon=True) for n in range(sessions)]
    try:
        for thread in threads:
            thread.start()
        passes_before, cpu_before = model.batched_head.passes, _client_cpu_s(swarm_pids)
        start.wait()
        for thread in threads:
            thread.join(300)
        cpu_ms = (_client_cpu_s(swarm_pids) - cpu_before) * 1000
        passes = model.batched_head.passes - passes_before
    finally:
        for session in opened:
            session.close()
    if failures or any(thread.is_alive() for thread in threads):
        raise RuntimeError(f"a generation failed or hung: {failures[:1]}")
    return Round(cpu_ms, sessions * tokens, passes)


def measure(server_flags: Sequence[str], *, max_length: int, sessions: int = 8, tokens: int = 24) -> ClientWork:
    """Runs the rig (module docstring) with a server started with `server_flags` (room for `sessions` sessions of
    `max_length`)."""
    with tempfile.TemporaryDirectory(prefix="client-work-") as scratch, \
            SwarmProcesses(Path(scratch), announce_period_s=5.0, record_ttl_s=30.0, torch_threads=1) as swarm:
        swarm.start_dht()
        swarm.start_server(DEFAULT_MODEL, "0:30", *server_flags, name="a")
        swarm_pids = {proc.popen.pid for proc in swarm.procs}
        model = DistributedModelForCausalLM.from_pretrained(DEFAULT_MODEL, initial_peers=swarm.initial_peers,
                                                            client_config=ClientConfig(orchestrator=None))
        try:
            _generate_round(model, sessions, 4, max_length, 0, swarm_pids)  # warm: routes, connections, threads
            readings = {}
            for count in (1, sessions):
                rounds = [_generate_round(model, count, tokens, max_length, 100 * (r + 1), swarm_pids)
                          for r in range(ROUNDS)]
                readings[count] = sorted(rounds, key=lambda round_: round_.cpu_ms / round_.tokens)[ROUNDS // 2]
        finally:
            model.shutdown()
    pass_ms, token_ms = split_cost(readings[1], readings[sessions])
    return ClientWork(pass_ms, token_ms, readings[1], readings[sessions], sessions)


def split_cost(lone: Round, shared: Round) -> tuple[float, float]:
    """Gives (a pass's, a token's) CPU from two rounds whose tokens share passes unequally: the solution of cpu =
    passes x pass + tokens x token for both, both costs kept at 0 or more (the other then fits the lone round)."""
    determinant = lone.passes * shared.tokens - shared.passes * lone.tokens
    if determinant <= 0:
        raise ValueError(f"the rounds share passes alike ({lone} and {shared}): nothing tells a pass from a token")
    pass_ms = (lone.cpu_ms * shared.tokens - shared.cpu_ms * lone.tokens) / determinant
    token_ms = (shared.cpu_ms * lone.passes - lone.cpu_ms * shared.passes) / determinant
    if pass_ms < 0:
        return 0.0, lone.cpu_ms / lone.tokens
    if token_ms < 0:
        return lone.cpu_ms / lone.passes, 0.0
    return pass_ms, token_ms


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=24)
    args = parser.parse_args(argv)
    from benchmarks.kunserve_burst import MAX_OUTPUT, MAX_PROMPT, server_flags

    reading = measure(server_flags("no drop", "a", args.sessions)[1], max_length=MAX_PROMPT + MAX_OUTPUT,
                      sessions=args.sessions, tokens=args.tokens)
    lone, shared = reading.lone, reading.shared
    print(f"the client's CPU: {reading.pass_ms:.1f} ms a head pass + {reading.token_ms:.1f} ms a token (one session: "
          f"{lone.cpu_ms:.0f} ms over {lone.tokens} tokens in {lone.passes} passes; {reading.sessions}: "
          f"{shared.cpu_ms:.0f} ms over {shared.tokens} tokens in {shared.passes} passes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
