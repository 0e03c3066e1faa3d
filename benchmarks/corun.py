"""What computing on every core at once costs this machine: a server's work alone, then in one process per core.

    python benchmarks/corun.py [--blocks 15] [--seconds 4] [--rounds 2]

`kunserve_burst.py`'s simulator shares the machine's cores among the processes that compute
(`KunServeSimConfig.cores`): work runs slower once more of them compute than there are cores. On a VM, computing on
every core at once costs more than that: the host takes time from vCPUs that are all busy (steal), and the cores
share caches and memory. The simulator takes that from this reading (`KunServeSimConfig.corun_stretch`).

Each process builds the served model's first `--blocks` blocks, as a server hosting them does (one torch thread), and
computes what a server's batches hold, one after the other: a prompt's chunk of `CHUNK_TOKENS` and a decode step of
`DECODE_ROWS` sessions, both after `HISTORY_TOKENS` of history. One process computes alone for `--seconds`, then one
per core at once for as long, `--rounds` times in turn. The reading (`stretch`, the median over the rounds) is what a
live server's batches show as their wall time over their CPU time: a round of work's wall time over its CPU time with
every core computing, against the same alone. Beside it, the wall time and the CPU time together over alone: this
kernel takes the host's steal out of a thread's CPU time, so on a VM the CPU time falls as the wall time grows.

On the Intel VM (2 vCPUs, 2026-12-07, 14 readings): wall over CPU 1.05-1.15x with both cores computing; the wall
time 1.04-1.15x, the CPU time 0.96-1.02x.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from swarm.memory import PagePool
from swarm.model import BlockRange, resolve_model
from swarm.model.paged_kv import PagedBatch, SequenceChunk

CHUNK_TOKENS = 118  # a prompt's chunk as a server cuts one beside ten other sessions (128 tokens, a row each)
DECODE_ROWS = 5  # a pipeline member's decode batch under a burst (r84)
HISTORY_TOKENS = 256  # what each sequence attends over
WARMUP = 2  # rounds of work before timing


@dataclass(frozen=True)
class Corun:
    """The reading: with every one of `cores` cores computing, how many times a round of work's wall time over its
    CPU time alone it took (`stretch`), and its wall time and CPU time over alone; a round's wall time alone (ms)."""

    cores: int
    stretch: float
    wall: float
    cpu: float
    alone_ms: float
    blocks: int
    rounds: int


def _work(blocks: int, seconds: float, start: multiprocessing.synchronize.Barrier, out: multiprocessing.Queue) -> None:
    """In a process of its own: builds `blocks` blocks, waits for the others at `start`, then computes rounds of
    work for `seconds` and puts (rounds, wall s, CPU s) on `out`."""
    torch.set_num_threads(1)
    source = resolve_model()
    hosted = BlockRange(source, 0, blocks)
    sequence = HISTORY_TOKENS + CHUNK_TOKENS
    page_bytes = sequence * hosted.kv_bytes_per_token()
    rows = DECODE_ROWS + 1  # the chunk's sequence, then the decode step's
    kv = hosted.paged_kv(PagePool(blocks * rows * page_bytes, page_bytes).storage, page_bytes)

    def pages(row: int) -> dict[int, list[int]]:  # a page per block for each sequence
        return {index: [index * rows + row] for index in range(blocks)}

    chunk = PagedBatch((SequenceChunk(0, CHUNK_TOKENS, HISTORY_TOKENS, 0, blocks, pages(0)),))
    decode = PagedBatch(tuple(SequenceChunk(row - 1, 1, HISTORY_TOKENS, 0, blocks, pages(row))
                              for row in range(1, rows)))
    generator = torch.Generator().manual_seed(0)
    chunk_in = torch.randn(CHUNK_TOKENS, hosted.hidden_size, generator=generator)
    decode_in = torch.randn(DECODE_ROWS, hosted.hidden_size, generator=generator)

    def one_round() -> None:
        hosted(chunk_in, chunk, kv)
        hosted(decode_in, decode, kv)

    for _ in range(WARMUP):
        one_round()
    start.wait()
    done, wall_started, cpu_started = 0, time.perf_counter(), time.thread_time()
    while time.perf_counter() - wall_started < seconds:
        one_round()
        done += 1
    out.put((done, time.perf_counter() - wall_started, time.thread_time() - cpu_started))


def _timed(processes: int, blocks: int, seconds: float) -> tuple[float, float]:
    """Gives a round's mean wall and CPU time (s) over `processes` processes computing at once."""
    context = multiprocessing.get_context("spawn")
    start, out = context.Barrier(processes), context.Queue()
    workers = [context.Process(target=_work, args=(blocks, seconds, start, out), daemon=True)
               for _ in range(processes)]
    for worker in workers:
        worker.start()
    try:
        readings = [out.get(timeout=seconds + 300) for _ in workers]
    finally:
        for worker in workers:
            worker.join(timeout=30)
            if worker.is_alive():
                worker.kill()
    rounds = sum(done for done, _, _ in readings)
    return sum(wall for _, wall, _ in readings) / rounds, sum(cpu for _, _, cpu in readings) / rounds


def measure_corun(*, blocks: int = 15, seconds: float = 4.0, rounds: int = 2, cores: int | None = None) -> Corun:
    """Takes the reading: `rounds` times, one process alone and then one per core at once (`cores`: this machine's)."""
    cores = cores or os.cpu_count() or 1
    stretches, walls, cpus, alone_ms = [], [], [], []
    for _ in range(rounds):
        alone_wall, alone_cpu = _timed(1, blocks, seconds)
        wall, cpu = _timed(cores, blocks, seconds)
        stretches.append((wall / cpu) / (alone_wall / alone_cpu))
        walls.append(wall / alone_wall)
        cpus.append(cpu / alone_cpu)
        alone_ms.append(alone_wall * 1000)
    return Corun(cores, statistics.median(stretches), statistics.median(walls), statistics.median(cpus),
                 statistics.median(alone_ms), blocks, rounds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=15, help="blocks each process computes (default: 15)")
    parser.add_argument("--seconds", type=float, default=4.0, help="how long each timing computes (default: 4)")
    parser.add_argument("--rounds", type=int, default=2, help="timings alone and together, in turn (default: 2)")
    args = parser.parse_args(argv)
    reading = measure_corun(blocks=args.blocks, seconds=args.seconds, rounds=args.rounds)
    print(f"{reading.cores} cores, {reading.blocks} blocks: a round of work (a {CHUNK_TOKENS}-token chunk and a "
          f"{DECODE_ROWS}-row decode step after {HISTORY_TOKENS} tokens) took {reading.alone_ms:.1f} ms alone")
    print("| computing | wall over CPU time | wall time | CPU time |")
    print("|---|---|---|---|")
    print("| alone | 1.00x | 1.00x | 1.00x |")
    print(f"| on every core at once | {reading.stretch:.2f}x | {reading.wall:.2f}x | {reading.cpu:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
