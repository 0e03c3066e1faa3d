"""Batched serving: aggregate decode tokens/s of concurrent sessions, admission with paged KV, and a long prompt's
time to first token while others decode, each next to its reference in the same run.

Three parts, on the embedded SmolLM2-135M-Instruct (float32, CPU):

1. **Throughput.** A 3-server loopback swarm (blocks 0:10, 10:20, 20:30; each server on `cores // 3` torch threads,
   as the demo starts them). For each session count N (1, 4, 8, 16), rounds alternate: the local Hugging Face model
   generates N prompts of equal length as one batch (no padding), then N threads of one swarm client generate the
   same prompts, one session each. Two rates: all new tokens over the time from the first request to the last
   token, and aggregate decode tokens/s, the tokens after each sequence's first over the time from the first
   sequence's first token to the last sequence's last (prefill excluded). Ratios are of the medians; the verdict
   is on the decode rate. Greedy tokens are compared with the local batch.
2. **Admission.** One server hosting 0:30 with `--memory 1GB`; clients open sessions of max_length 2048 and prefill
   32 tokens each until the server answers `ServerBusy`. Measured twice: with `--kv-headroom-tokens 2048`, which
   admits exactly as the server did before paged KV (every session holds pages for max_length), and with the
   default headroom.
3. **A long prompt among decoding sessions.** On a fresh 3-server swarm per `--max-batch-tokens` value: 8 sessions
   decode; a 512-token prompt arrives; its time to first token and, per server, how much longer the others' decode
   steps took there while they shared batches with the prompt's chunks (the slowest such step less the server's
   mean decode step without a prefill beside it), next to the mean time of the prompt's batches on that server.
   The verdict pairs each decode step with the batch it shared with a chunk: a step's delay (its latency less a lone
   decode step's) is at most that chunk's batch when it waited no longer than a lone decode step before the batch
   (`info`: `decode_step_ms.beside_prefill_beyond_its_batch`, the latency less the batch's compute). The largest
   extra gap between two tokens a decoding client saw is printed too (it adds up all servers).
4. **The ceiling of the ratio on this machine.** In this process, with no network: one decode step of the N
   sessions through the three servers' blocks back to back (`BlockRange`, paged KV, as the servers compute it) and
   the client's LM head, against one decode step of the local model for the same batch, interleaved. The stages on
   one thread each, as the servers run, and on two (what each server would compute with both cores to itself and
   its threads spinning between operators). A swarm whose stages run one after another for one group of sessions
   cannot beat this ratio, whatever its transport.

    .venv/bin/python benchmarks/throughput.py [--sessions 1,4,8,16] [--rounds 3] [--new-tokens 32]
        [--chunks 256] [--skip-admission] [--skip-prefill] [--skip-ceiling]

Target (issue 10): 8 sessions >= 0.8x the local batch; the 512-token arrival delays the others' decode steps by at
most one chunk. It prints tables and verdicts and never asserts.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM
from transformers.generation.streamers import BaseStreamer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from client import DistributedModelForCausalLM, SwarmClient
from client.timing import StepClock
from swarm.errors import ServerBusy
from swarm.local_swarm import SwarmProcesses, threads_per_server
from swarm.memory import PagePool
from swarm.model import DEFAULT_MODEL, BlockRange, ClientHead, ModelSource, PagedBatch, SequenceChunk, resolve_model
from swarm.wire import encode_tensor

TARGET_RATIO = 0.8
TARGET_SESSIONS = 8
SPLITS = ("0:10", "10:20", "20:30")
LONG_PROMPT_TOKENS = 512
TIMEOUT_S = 600.0


class BatchClock(BaseStreamer):
    """Stamps every step of a batched generate(): each sequence of the batch gets its tokens at the same moments."""

    def __init__(self, sequences: int) -> None:
        self.clocks = [StepClock() for _ in range(sequences)]

    def put(self, value: torch.Tensor) -> None:
        for clock in self.clocks:
            clock.put(value)

    def end(self) -> None:
        pass


def prompts(count: int, tokens: int, seed: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(100, 40_000, (1, tokens), generator=generator) for _ in range(count)]


SERVER_THREADS = threads_per_server(len(SPLITS))


def start_swarm(workdir: Path, source: ModelSource, threads: int, *extra: str) -> SwarmProcesses:
    """Gives a running 3-server swarm; if a process fails to start, the others are stopped before the error rises."""
    swarm = SwarmProcesses(workdir, torch_threads=threads)
    try:
        swarm.start_dht()
        servers = [swarm.start_server(source.path, blocks, *extra, wait=False) for blocks in SPLITS]
        for server in servers:
            swarm.wait_ready(server)
    except BaseException:
        swarm.close()
        raise
    return swarm


def generate_in_threads(
    model: DistributedModelForCausalLM, inputs: list[torch.Tensor], new_tokens: int,
    clocks: list[StepClock] | None = None, start_s: list[float] | None = None,
) -> tuple[list[list[int]], float]:
    """Gives each prompt's greedy tokens, each generated by a thread of its own, and the wall time of all."""
    outputs: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def run(index: int) -> None:
        try:
            if start_s is not None:
                time.sleep(max(0.0, start_s[index] - time.perf_counter()))
            streamer = clocks[index] if clocks is not None else None
            output = model.generate(inputs[index], max_new_tokens=new_tokens, eos_token_id=None,
                                    do_sample=False, streamer=streamer)
            outputs[index] = output[0].tolist()
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=run, args=(index,)) for index in range(len(inputs))]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=TIMEOUT_S)
    elapsed = time.perf_counter() - started
    if errors:
        raise errors[0]
    return [outputs[index] for index in range(len(inputs))], elapsed


@dataclass
class ThroughputRow:
    sessions: int
    local_tok_s: list[float] = field(default_factory=list)  # all new tokens over the whole run
    swarm_tok_s: list[float] = field(default_factory=list)
    local_decode_tok_s: list[float] = field(default_factory=list)  # tokens after each first one, after prefill
    swarm_decode_tok_s: list[float] = field(default_factory=list)
    match: bool = True
    mean_steps_per_batch: float = 0.0

    @property
    def ratio(self) -> float:
        return statistics.median(self.swarm_tok_s) / statistics.median(self.local_tok_s)

    @property
    def decode_ratio(self) -> float:
        return statistics.median(self.swarm_decode_tok_s) / statistics.median(self.local_decode_tok_s)


def decode_tok_s(clocks: list[StepClock]) -> float:
    """Gives aggregate decode tokens/s: the tokens after each sequence's first, from the moment the first sequence
    had its first token to the moment the last one had its last (prefill and time to first token excluded)."""
    tokens = sum(len(clock.stamps_s) - 2 for clock in clocks)  # stamps: the prompt, then each generated token
    started = min(clock.stamps_s[1] for clock in clocks)
    ended = max(clock.stamps_s[-1] for clock in clocks)
    return tokens / (ended - started)


def server_infos(client: SwarmClient) -> dict[int, dict]:
    replies = {}
    for record in client.run(client.servers()).values():
        connection = client.run(client.connect(record))
        try:
            replies[record.block_start] = client.run(connection.call("info", {}, timeout=60))
        finally:
            client.run(connection.close())
    return replies


def steps_and_batches(client: SwarmClient) -> tuple[int, int]:
    infos = server_infos(client)
    steps = sum(sum(info["steps_computed"].values()) for info in infos.values())
    batches = sum(info["batches"]["batches"] for info in infos.values())
    return steps, batches


def measure_throughput(args: argparse.Namespace, source: ModelSource, workdir: Path) -> list[ThroughputRow]:
    local = AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.float32).eval()
    rows = []
    with start_swarm(workdir / "throughput", source, args.server_threads) as swarm:
        model = DistributedModelForCausalLM.from_pretrained(DEFAULT_MODEL, initial_peers=swarm.initial_peers)
        try:
            generate_in_threads(model, prompts(2, args.prompt_tokens, 99), 4)  # warm-up: routes, RTTs, streams
            for count in args.sessions:
                row = ThroughputRow(count)
                inputs = prompts(count, args.prompt_tokens, seed=count)
                batch = torch.cat(inputs)
                for round_index in range(args.rounds):
                    local_clock = BatchClock(count)
                    started = time.perf_counter()
                    with torch.inference_mode():
                        expected = local.generate(batch, attention_mask=torch.ones_like(batch),
                                                  max_new_tokens=args.new_tokens, eos_token_id=None,
                                                  do_sample=False, streamer=local_clock)
                    row.local_tok_s.append(count * args.new_tokens / (time.perf_counter() - started))
                    row.local_decode_tok_s.append(decode_tok_s(local_clock.clocks))
                    steps_before, batches_before = steps_and_batches(model.swarm)
                    clocks = [StepClock() for _ in inputs]
                    outputs, elapsed = generate_in_threads(model, inputs, args.new_tokens, clocks)
                    steps_after, batches_after = steps_and_batches(model.swarm)
                    row.swarm_tok_s.append(count * args.new_tokens / elapsed)
                    row.swarm_decode_tok_s.append(decode_tok_s(clocks))
                    row.match &= outputs == expected.tolist()
                    row.mean_steps_per_batch = (steps_after - steps_before) / max(1, batches_after - batches_before)
                    print(f"  {count} session(s), round {round_index + 1}/{args.rounds}: local "
                          f"{row.local_tok_s[-1]:.1f} tok/s (decode {row.local_decode_tok_s[-1]:.1f}), swarm "
                          f"{row.swarm_tok_s[-1]:.1f} tok/s (decode {row.swarm_decode_tok_s[-1]:.1f}), "
                          f"{row.mean_steps_per_batch:.1f} steps per batch", flush=True)
                rows.append(row)
        finally:
            model.shutdown()
    return rows


def count_admitted(source: ModelSource, workdir: Path, *extra: str) -> tuple[int, int]:
    """Gives how many 2048-token sessions one 0:30 server with 1 GB admits, and its KV pages before any."""
    with SwarmProcesses(workdir, torch_threads=threads_per_server(1)) as swarm:
        swarm.start_dht()
        swarm.start_server(source.path, "0:30", "--memory", "1GB", "--max-length", "2048", *extra)
        client = SwarmClient(source.model_id, source.num_blocks, swarm.initial_peers)
        connections = []
        try:
            (record,) = client.run(client.servers()).values()
            hidden = encode_tensor(torch.zeros(1, 32, source.config.hidden_size))
            admitted = 0
            for _ in range(1000):
                connection = client.run(client.connect(record))
                connections.append(connection)
                try:
                    reply = client.run(connection.call("open", {"blocks": [0, 30], "max_length": 2048}, timeout=60))
                except ServerBusy:
                    break
                client.run(connection.call("step", {"session_id": reply["session_id"], "hidden": hidden}, timeout=60))
                admitted += 1
            return admitted, record.pages_free
        finally:
            for connection in connections:
                client.run(connection.close())
            client.shutdown()


@dataclass
class PrefillRow:
    max_batch_tokens: int
    ttft_ms: float
    extra_gap_ms: float  # the largest extra gap between two tokens of a decoding session, seen by its client
    step_delays: dict[int, tuple[float, float]]  # server -> (its worst extra decode step time, one prompt batch)
    # server -> (the longest a decode step beside the prompt waited before the batch it shared with a chunk, the
    # server's mean decode step without a prefill beside it)
    waits: dict[int, tuple[float, float]]
    chunk_alone_ms: float  # one chunk through 10 blocks on an idle machine
    match: bool

    @property
    def worst(self) -> tuple[int, float, float]:
        """Gives the server whose decode steps waited longest before their own batch, relative to a lone decode
        step there: a step's delay is at most the chunk it computed beside while that wait is at most a lone step."""
        start, (wait, lone) = max(self.waits.items(), key=lambda item: item[1][0] - item[1][1])
        return start, wait, lone


def chunk_compute_ms(source: ModelSource, tokens: int) -> float:
    """Gives the compute time of one prefill chunk of `tokens` tokens through 10 blocks on one torch thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(threads_per_server(len(SPLITS)))
    try:
        blocks = BlockRange(source, 0, 10)
        pool = PagePool(64 << 20, 1 << 20)
        kv = blocks.paged_kv(pool.storage, pool.page_bytes)
        chunk = PagedBatch((SequenceChunk(0, tokens, 0, 0, 10, {block: [block] for block in range(10)}),))
        hidden = torch.randn(tokens, source.config.hidden_size)
        blocks(hidden, chunk, kv)
        samples = []
        for _ in range(5):
            started = time.perf_counter()
            blocks(hidden, chunk, kv)
            samples.append((time.perf_counter() - started) * 1000)
        return statistics.median(samples)
    finally:
        torch.set_num_threads(threads)


def measure_long_prompt(args: argparse.Namespace, source: ModelSource, workdir: Path, chunk: int) -> PrefillRow:
    local = AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.float32).eval()
    long_prompt = prompts(1, LONG_PROMPT_TOKENS, seed=512)[0]
    decoding = prompts(TARGET_SESSIONS, args.prompt_tokens, seed=8)
    decode_tokens = 48
    with start_swarm(workdir / f"prefill-{chunk}", source, args.server_threads, "--max-batch-tokens",
                     str(chunk)) as swarm:
        model = DistributedModelForCausalLM.from_pretrained(DEFAULT_MODEL, initial_peers=swarm.initial_peers)
        try:
            generate_in_threads(model, prompts(2, args.prompt_tokens, 99), 4)
            clocks = [StepClock() for _ in decoding]
            arrival: dict[str, float] = {}
            long_output: list[list[int]] = []

            def long_request() -> None:
                time.sleep(1.5)  # the 8 sessions are decoding by now
                clock = StepClock()
                with model.inference_session(max_length=LONG_PROMPT_TOKENS + 1) as session:
                    arrival["at"] = time.perf_counter()
                    output = model.generate(long_prompt, session=session, max_new_tokens=1, do_sample=False,
                                            streamer=clock)
                    # Each server computed the prompt chunk by chunk: its time per batch, by first block
                    arrival.update({f"chunk_ms@{span.blocks[0]}": span.compute_ms / span.batches
                                    for span in session.timings()})
                arrival["first_token"] = clock.stamps_s[1]
                long_output.append(output[0].tolist())

            arriving = threading.Thread(target=long_request)
            arriving.start()
            outputs, _ = generate_in_threads(model, decoding, decode_tokens, clocks)
            arriving.join(timeout=TIMEOUT_S)
            infos = server_infos(model.swarm)
            decode_step_ms = {start: info["batches"]["decode_step_ms"] for start, info in infos.items()}
        finally:
            model.shutdown()
    expected = [local.generate(ids, max_new_tokens=decode_tokens, eos_token_id=None,
                               do_sample=False)[0].tolist() for ids in decoding]
    expected_long = local.generate(long_prompt, max_new_tokens=1, do_sample=False)[0].tolist()
    window = (arrival["at"], arrival["first_token"])
    extra = []
    for clock in clocks:
        pairs = list(zip(clock.stamps_s[1:], clock.stamps_s[2:], strict=False))  # between generated tokens
        gaps = [(later - earlier) * 1000 for earlier, later in pairs]
        during = [(later - earlier) * 1000 for earlier, later in pairs if later >= window[0] and earlier <= window[1]]
        if during:
            extra.append(max(during) - statistics.median(gaps))
    # Per server: its slowest decode step that shared a batch with the prompt's chunks, less its mean decode step
    # without a prefill beside it, next to the time of one of the prompt's batches there.
    step_delays = {
        start: (ms["beside_prefill"]["max_ms"] - ms["alone"]["mean_ms"], arrival[f"chunk_ms@{start}"])
        for start, ms in decode_step_ms.items() if ms["beside_prefill"]["count"]
    }
    # Per server, step by step: the longest a decode step waited before the batch it shared with a chunk (its
    # latency less that batch's compute), next to the mean decode step alone.
    waits = {
        start: (ms["beside_prefill_beyond_its_batch"]["max_ms"], ms["alone"]["mean_ms"])
        for start, ms in decode_step_ms.items() if ms["beside_prefill"]["count"]
    }
    return PrefillRow(
        max_batch_tokens=chunk, ttft_ms=(window[1] - window[0]) * 1000,
        extra_gap_ms=max(extra) if extra else float("nan"), step_delays=step_delays, waits=waits,
        chunk_alone_ms=chunk_compute_ms(source, chunk),
        match=outputs == expected and long_output == [expected_long],
    )


@dataclass
class CeilingRow:
    threads: int  # torch threads of each stage
    local_ms: float  # one decode step of the local model (torch's default threads)
    blocks_ms: float  # the three servers' blocks, back to back
    head_ms: float  # the client's LM head for every session's row (torch's default threads)

    @property
    def ratio(self) -> float:
        return self.local_ms / (self.blocks_ms + self.head_ms)


def measure_ceiling(args: argparse.Namespace, source: ModelSource, rounds: int = 15) -> list[CeilingRow]:
    """Gives the swarm's compute alone for one decode step of TARGET_SESSIONS sessions, stage after stage in this
    process, against the local model's decode step for the same batch, interleaved; medians of `rounds`."""
    sessions, history = TARGET_SESSIONS, args.prompt_tokens
    local = AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.float32).eval()
    head = ClientHead(source)
    stages = []
    for split in SPLITS:
        start, end = (int(part) for part in split.split(":"))
        blocks = BlockRange(source, start, end)
        pool = PagePool(sessions * (end - start) << 20, 1 << 20)  # a page per sequence and block holds its history
        kv = blocks.paged_kv(pool.storage, pool.page_bytes)
        pages = [{block: [index * (end - start) + block - start] for block in range(start, end)}
                 for index in range(sessions)]
        prefill = PagedBatch(tuple(SequenceChunk(index * history, history, 0, start, end, pages[index])
                                   for index in range(sessions)))
        decode = PagedBatch(tuple(SequenceChunk(index, 1, history, start, end, pages[index])
                                  for index in range(sessions)))
        stages.append((blocks, kv, prefill, decode))
    default_threads = torch.get_num_threads()
    ids = torch.cat(prompts(sessions, history, seed=sessions))
    rows = []
    with torch.inference_mode():
        for blocks, kv, prefill, _ in stages:
            blocks(torch.randn(sessions * history, source.config.hidden_size), prefill, kv)
        cache = local(ids, use_cache=True).past_key_values
        for threads in sorted({args.server_threads, default_threads}):
            local_ms, blocks_ms, head_ms = [], [], []
            for _ in range(rounds):
                torch.set_num_threads(default_threads)
                started = time.perf_counter()
                local(ids[:, -1:], past_key_values=cache, use_cache=True)
                local_ms.append((time.perf_counter() - started) * 1000)
                cache.crop(-1)  # back to the prompt alone
                torch.set_num_threads(threads)
                hidden = torch.randn(sessions, source.config.hidden_size)
                started = time.perf_counter()
                for blocks, kv, _, decode in stages:
                    hidden = blocks(hidden, decode, kv)
                blocks_ms.append((time.perf_counter() - started) * 1000)
                torch.set_num_threads(default_threads)
                started = time.perf_counter()
                head.logits(hidden)
                head_ms.append((time.perf_counter() - started) * 1000)
            rows.append(CeilingRow(threads, statistics.median(local_ms), statistics.median(blocks_ms),
                                   statistics.median(head_ms)))
    torch.set_num_threads(default_threads)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sessions", default="1,4,8,16", type=lambda text: [int(x) for x in text.split(",")])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--chunks", default="64,128,256", type=lambda text: [int(x) for x in text.split(",")],
                        help="--max-batch-tokens values for the long-prompt part")
    parser.add_argument("--server-threads", type=int, default=SERVER_THREADS, help="torch threads of each server")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--skip-admission", action="store_true")
    parser.add_argument("--skip-prefill", action="store_true")
    parser.add_argument("--skip-ceiling", action="store_true")
    args = parser.parse_args()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the servers run: idle OpenMP threads must not spin
    source = resolve_model(DEFAULT_MODEL)
    print(f"# chainswarm throughput benchmark, {datetime.datetime.now().isoformat(timespec='seconds')}")
    print(f"model: {DEFAULT_MODEL} ({source.num_blocks} blocks), float32, CPU; servers {' '.join(SPLITS)} on "
          f"{args.server_threads} torch thread(s) each")
    print(f"machine: {platform.platform()}, cpu_count={os.cpu_count()}, torch {torch.__version__}, "
          f"torch.get_num_threads()={torch.get_num_threads()}; loadavg {os.getloadavg()}")
    with tempfile.TemporaryDirectory(prefix="chainswarm-throughput-") as tmp:
        workdir = Path(tmp)
        verdicts: list[str] = []
        if not args.skip_throughput:
            print(f"\n## Throughput: {args.prompt_tokens}-token prompts, {args.new_tokens} new tokens each, greedy, "
                  f"median of {args.rounds} interleaved rounds")
            rows = measure_throughput(args, source, workdir)
            print("| sessions | local batch tok/s | swarm tok/s | ratio | local decode tok/s | swarm decode tok/s | "
                  "decode ratio | steps per batch (last round) | tokens match |")
            print("|---|---|---|---|---|---|---|---|---|")
            for row in rows:
                print(f"| {row.sessions} | {statistics.median(row.local_tok_s):.1f} | "
                      f"{statistics.median(row.swarm_tok_s):.1f} | {row.ratio:.2f} | "
                      f"{statistics.median(row.local_decode_tok_s):.1f} | "
                      f"{statistics.median(row.swarm_decode_tok_s):.1f} | {row.decode_ratio:.2f} | "
                      f"{row.mean_steps_per_batch:.1f} | {'yes' if row.match else 'NO'} |")
            target = next((row for row in rows if row.sessions == TARGET_SESSIONS), None)
            if target is not None:
                verdict = "PASS" if target.decode_ratio >= TARGET_RATIO else "FAIL"
                verdicts.append(f"{verdict}: {TARGET_SESSIONS} sessions reach >= {TARGET_RATIO}x the local batch's "
                                f"aggregate decode tokens/s: measured {target.decode_ratio:.2f}x (with prefill "
                                f"and time to first token: {target.ratio:.2f}x)")
        if not args.skip_admission:
            print("\n## Admission: sessions of max_length 2048 (32-token prompts) one 0:30 server with 1 GB admits")
            before, pages = count_admitted(source, workdir / "admit-before", "--kv-headroom-tokens", "2048")
            after, _ = count_admitted(source, workdir / "admit-after")
            print("| rule | sessions admitted |\n|---|---|")
            print(f"| every session holds pages for max_length (before paged KV) | {before} |")
            print(f"| paged KV, default headroom rule | {after} |")
            print(f"({pages} KV pages of 1 MiB free before any session)")
            verdicts.append(f"paged KV admits {after / max(1, before):.1f}x as many 2048-token sessions ({after} vs "
                            f"{before})")
        if not args.skip_prefill:
            print(f"\n## A {LONG_PROMPT_TOKENS}-token prompt arrives while {TARGET_SESSIONS} sessions decode")
            prefill_rows = [measure_long_prompt(args, source, workdir, chunk) for chunk in args.chunks]
            print("| --max-batch-tokens | time to first token ms | per server: worst extra decode step ms / mean "
                  "batch of the prompt ms | per server: longest wait before its own batch ms / mean lone decode "
                  "step ms | others' largest extra gap between tokens ms | one chunk alone ms | tokens match |\n"
                  "|---|---|---|---|---|---|---|")
            for row in prefill_rows:
                per_server = ", ".join(f"{start}: {delay:.0f} / {chunk:.0f}"
                                       for start, (delay, chunk) in sorted(row.step_delays.items()))
                waits = ", ".join(f"{start}: {wait:.0f} / {lone:.0f}"
                                  for start, (wait, lone) in sorted(row.waits.items()))
                print(f"| {row.max_batch_tokens} | {row.ttft_ms:.0f} | {per_server} | {waits} | {row.extra_gap_ms:.0f} "
                      f"| {row.chunk_alone_ms:.0f} | {'yes' if row.match else 'NO'} |")
            for row in prefill_rows:
                start, wait, lone = row.worst
                verdict = "PASS" if wait <= lone else "FAIL"
                verdicts.append(f"{verdict}: with --max-batch-tokens {row.max_batch_tokens} the arrival delays the "
                                f"others' decode steps by at most one chunk: no decode step waited longer before the "
                                f"batch it shared with a chunk than a lone decode step takes (worst {wait:.0f} ms vs "
                                f"{lone:.0f} ms, server of blocks from {start})")
        if not args.skip_ceiling:
            print(f"\n## The ceiling: one decode step of {TARGET_SESSIONS} sessions ({args.prompt_tokens} tokens of "
                  f"history), compute alone in one process, median of 15 interleaved")
            print("| threads per stage | local step ms | swarm's blocks back to back ms | client's head ms | "
                  "ceiling of the ratio |\n|---|---|---|---|---|")
            ceiling = measure_ceiling(args, source)
            for row in ceiling:
                print(f"| {row.threads} | {row.local_ms:.1f} | {row.blocks_ms:.1f} | {row.head_ms:.1f} | "
                      f"{row.ratio:.2f} |")
            served = next(row for row in ceiling if row.threads == args.server_threads)
            verdicts.append(f"with {served.threads} thread(s) per stage, as the servers run, compute alone caps "
                            f"the ratio at {served.ratio:.2f}x before any network")
        print()
        for line in verdicts:
            print(f"verdict: {line}")


if __name__ == "__main__":
    main()
