"""Swarm overhead vs the local model: decode tokens/s, time to first token and per-hop latency, in one run.

Runs the embedded SmolLM2-135M-Instruct locally (Hugging Face, float32) and through fresh loopback swarms of
1, 2 and 3 `swarm-server` processes (blocks split evenly), greedy, with and without server-to-server push, and
prints one table and a one-line verdict against the target "3-server swarm reaches >= 0.85x local decode
tokens/s" (with push, the default). It never asserts.

The local model runs in this process with torch's defaults; each round also runs it on one torch thread, printed
for reference (the verdict is against torch's defaults). The servers split the machine's cores between them, as the
demo's do (`threads_per_server`). Each swarm client runs in a process of its own that, like the servers it shares
the machine with, runs OpenMP threads passively (see `ClientProcess`). Both paths are
timed the same way: a streamer stamps `time.perf_counter()` at every token `generate()` emits.
Time to first token is prefill plus the first token; decode tokens/s counts only the tokens after it. For the
swarm, the session is opened (route + `open` calls) before the clock starts; its cost is printed separately.

    .venv/bin/python benchmarks/overhead.py [--max-new-tokens 48] [--prompt-tokens 32] [--repeats 3] [--servers 1,2,3]

The machine may be shared: each run also reports the CPU share other processes took meanwhile, and the verdict is
flagged UNRELIABLE when that exceeds 10%.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import itertools
import json
import os
import platform
import select
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from client import ClientConfig, DistributedModelForCausalLM
from client.inference import InferenceSession
from client.timing import StepClock
from swarm.local_swarm import SwarmProcesses, threads_per_server
from swarm.model import DEFAULT_MODEL, ModelSource, resolve_model

TARGET_RATIO = 0.85
TARGET_SERVERS = 3
BUSY_MACHINE_PCT = 10.0  # others' share of all CPUs above which a verdict is flagged unreliable
PROMPT_TEXT = (
    "The history of distributed computing begins with time-sharing systems, where many users shared one "
    "machine. Later, networks of workstations cooperated on large problems, splitting work between nodes. "
)
WORKER_TIMEOUT_S = 600.0  # one warm-up or timed run of the client worker
NOOP_PROBES = 20  # `info` round trips per server, to price a hop that computes nothing


class OthersCpu:
    """Measures the share of all CPUs that processes outside this benchmark's tree used since its construction.

    The machine may be shared; a run during which others used much CPU says little about chainswarm.
    """

    def __init__(self, root_pid: int | None = None) -> None:
        self.root_pid = root_pid or os.getpid()  # the benchmark's main process; its whole tree is "own"
        self._start = self._sample()

    def _sample(self) -> tuple[float, float, float]:
        system = psutil.cpu_times()
        # guest time is already counted in user time
        total_s = sum(system) - getattr(system, "guest", 0.0) - getattr(system, "guest_nice", 0.0)
        busy_s = total_s - system.idle - getattr(system, "iowait", 0.0)
        own_s = 0.0
        root = psutil.Process(self.root_pid)
        for proc in [root, *root.children(recursive=True)]:
            try:
                times = proc.cpu_times()
                own_s += times.user + times.system
            except psutil.Error:  # exited between listing and reading
                pass
        return total_s, busy_s, own_s

    def percent(self) -> float:
        """Gives others' CPU use since construction, in % of all CPUs (0-100)."""
        total_s, busy_s, own_s = self._sample()
        elapsed_s = total_s - self._start[0]
        others_s = (busy_s - self._start[1]) - (own_s - self._start[2])
        return max(0.0, 100 * others_s / elapsed_s) if elapsed_s > 0 else float("nan")


@dataclass
class HopSample:
    """One server's decode-step timings in one timed run (prefill excluded)."""

    blocks: tuple[int, int]
    steps: int
    round_trip_ms: float
    compute_ms: float


@dataclass
class RunSample:
    """One timed generate()."""

    ttft_ms: float
    decode_tokens_per_s: float
    tokens: list[int]
    hops: list[HopSample] = field(default_factory=list)
    open_ms: float = 0.0
    step_ms: float = float("nan")  # swarm only: mean wall time of a decode step in the swarm (client loop included)
    others_cpu_pct: float = 0.0
    body_ms: float = float("nan")  # local only: mean time per decode step in the transformer blocks


@dataclass
class ConfigResult:
    """The medians of one configuration's timed runs, plus diagnostics."""

    name: str
    servers: int
    runs: list[RunSample]
    noop_rtt_ms: list[float] = field(default_factory=list)  # per server, median of `info` round trips
    paired_local: ConfigResult | None = None  # local runs interleaved with this swarm's runs
    paired_local_one_thread: ConfigResult | None = None  # the same, with torch on one thread
    torch_threads: int = 0  # swarm only: the servers' --torch-threads (0: torch's choice)
    error: str | None = None
    push: bool | None = None  # swarm only: whether servers pushed hidden states to the next server

    @property
    def ttft_ms(self) -> float:
        return statistics.median(run.ttft_ms for run in self.runs)

    @property
    def decode_tokens_per_s(self) -> float:
        return statistics.median(run.decode_tokens_per_s for run in self.runs)

    @property
    def others_cpu_max_pct(self) -> float:
        """Gives the most CPU other processes took during any timed run of this config or its paired local runs."""
        runs = [*self.runs, *(self.paired_local.runs if self.paired_local else [])]
        return max((run.others_cpu_pct for run in runs), default=float("nan"))

    @property
    def open_ms(self) -> float:
        return statistics.median(run.open_ms for run in self.runs)

    @property
    def ratio_vs_local(self) -> float:
        """Gives decode tokens/s relative to the local runs taken alongside (run for run, under the same load)."""
        if self.paired_local is None:
            return float("nan")
        return self.decode_tokens_per_s / self.paired_local.decode_tokens_per_s

    @property
    def ratio_vs_local_one_thread(self) -> float:
        """Gives decode tokens/s relative to the one-thread local runs taken alongside."""
        if self.paired_local_one_thread is None:
            return float("nan")
        return self.decode_tokens_per_s / self.paired_local_one_thread.decode_tokens_per_s

    def median_run(self) -> RunSample:
        """Gives the run with the median decode tokens/s (the upper one of an even count)."""
        return sorted(self.runs, key=lambda run: run.decode_tokens_per_s)[len(self.runs) // 2]

    def hops(self) -> list[tuple[tuple[int, int], float, float]]:
        """Gives, per server in chain order, (blocks, RTT ms per step, compute ms per step) of the median run.

        One run, not per-column medians, so that a step's parts add up to the step under a fluctuating load.
        """
        return [
            (hop.blocks, hop.round_trip_ms / hop.steps, hop.compute_ms / hop.steps) for hop in self.median_run().hops
        ]


def even_block_ranges(num_blocks: int, servers: int) -> list[str]:
    """Gives `servers` contiguous ranges covering [0, num_blocks), as even as possible."""
    bounds = [round(i * num_blocks / servers) for i in range(servers + 1)]
    return [f"{start}:{end}" for start, end in itertools.pairwise(bounds)]


def fixed_prompt(source: ModelSource, prompt_tokens: int) -> torch.Tensor:
    """Gives exactly `prompt_tokens` ids of a fixed English text (repeated as needed)."""
    tokenizer = AutoTokenizer.from_pretrained(source.path)
    ids = tokenizer(PROMPT_TEXT, add_special_tokens=False)["input_ids"]
    ids = (ids * (prompt_tokens // len(ids) + 1))[:prompt_tokens]
    return torch.tensor([ids], dtype=torch.long)


def generate_kwargs(max_new_tokens: int) -> dict[str, object]:
    # min_new_tokens keeps every run at full length even if greedy decoding would hit end-of-sequence.
    return {
        "max_new_tokens": max_new_tokens,
        "min_new_tokens": max_new_tokens,
        "do_sample": False,
        "temperature": None,
        "top_p": None,
        "top_k": None,
    }


def summarize_clock(clock: StepClock, started_s: float, input_len: int, output: torch.Tensor) -> RunSample:
    stamps = clock.stamps_s
    ttft_ms = (stamps[1] - started_s) * 1000
    decode_tokens = len(stamps) - 2
    decode_s = stamps[-1] - stamps[1]
    return RunSample(
        ttft_ms, decode_tokens / decode_s if decode_s > 0 else float("nan"), output[0, input_len:].tolist()
    )


def run_local(model: AutoModelForCausalLM, input_ids: torch.Tensor, max_new_tokens: int) -> RunSample:
    # Hooks time the decoder body (what the servers run), so a step splits into body and head + generate.
    body_ms: list[float] = []
    entered_s = [0.0]
    body = model.get_decoder()
    hooks = [
        body.register_forward_pre_hook(lambda *_: entered_s.__setitem__(0, time.perf_counter())),
        body.register_forward_hook(lambda *_: body_ms.append((time.perf_counter() - entered_s[0]) * 1000)),
    ]
    clock = StepClock()
    others = OthersCpu()
    try:
        started_s = time.perf_counter()
        with torch.inference_mode():
            output = model.generate(input_ids, streamer=clock, **generate_kwargs(max_new_tokens))
    finally:
        for hook in hooks:
            hook.remove()
    sample = summarize_clock(clock, started_s, input_ids.shape[1], output)
    sample.others_cpu_pct = others.percent()
    sample.body_ms = statistics.mean(body_ms[1:]) if len(body_ms) > 1 else float("nan")  # [0] is the prefill
    return sample


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Runs the block with torch's intra-op threads set to `count`, then restores them."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _snapshot(session: InferenceSession) -> list[tuple[tuple[int, int], int, float, float]]:
    return [(t.blocks, t.steps, t.round_trip_ms, t.compute_ms) for t in session.timings()]


def run_swarm(
    model: DistributedModelForCausalLM, input_ids: torch.Tensor, max_new_tokens: int, root_pid: int | None = None
) -> RunSample:
    opened_s = time.perf_counter()
    session = model.inference_session(max_length=input_ids.shape[1] + max_new_tokens)
    open_ms = (time.perf_counter() - opened_s) * 1000
    step_ms: list[float] = []
    session_step = session.step

    def timed_step(hidden: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        started_s = time.perf_counter()
        output = session_step(hidden, **kwargs)
        step_ms.append((time.perf_counter() - started_s) * 1000)
        return output

    session.step = timed_step  # type: ignore[method-assign]
    with session:
        after_prefill: list[tuple[tuple[int, int], int, float, float]] = []
        clock = StepClock(on_first_token=lambda: after_prefill.extend(_snapshot(session)))
        others = OthersCpu(root_pid)
        started_s = time.perf_counter()
        output = model.generate(input_ids, session=session, streamer=clock, **generate_kwargs(max_new_tokens))
        sample = summarize_clock(clock, started_s, input_ids.shape[1], output)
        sample.others_cpu_pct = others.percent()
        for before, after in zip(after_prefill, _snapshot(session), strict=True):
            sample.hops.append(HopSample(after[0], after[1] - before[1], after[2] - before[2], after[3] - before[3]))
        if session.failovers:
            print(f"  warning: {session.failovers} failover(s) during a timed run", flush=True)
    sample.open_ms = open_ms
    sample.step_ms = statistics.mean(step_ms[1:])  # [0] is the prefill
    return sample


def probe_noop_rtt(model: DistributedModelForCausalLM, session: InferenceSession) -> list[float]:
    """Gives, per server of the session's chain, the median round trip of an `info` call (no block compute)."""

    async def probe() -> list[float]:
        medians = []
        for span_session in session.remote.spans:
            samples = []
            for _ in range(NOOP_PROBES):
                started = time.perf_counter()
                await span_session.connection.call("info", {}, timeout=10)
                samples.append((time.perf_counter() - started) * 1000)
            medians.append(statistics.median(samples))
        return medians

    return model.swarm.run(probe())


class ClientProcess:
    """A swarm client in its own process, configured as a client sharing the machine with servers is.

    Like the servers, it runs OpenMP threads passively (OMP_WAIT_POLICY=PASSIVE, set before torch loads): idle
    spinning threads would take the cores the servers compute on. The local model keeps torch's defaults in the
    benchmark's own process, so each side runs as it would on its own.
    """

    def __init__(self, initial_peers: list[str], *, push: bool, args: argparse.Namespace) -> None:
        command = [
            sys.executable, __file__, "--client-worker", "--prompt-tokens", str(args.prompt_tokens),
            "--max-new-tokens", str(args.max_new_tokens), "--root-pid", str(os.getpid()),
            "--push" if push else "--no-push", "--initial-peers", *initial_peers,
        ]
        env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", PYTHONUNBUFFERED="1")
        self.popen = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)

    def request(self, command: str) -> object:
        """Sends one command; gives the JSON the worker answers with (a bounded wait)."""
        assert self.popen.stdin is not None and self.popen.stdout is not None
        self.popen.stdin.write(command + "\n")
        self.popen.stdin.flush()
        # The worker answers one line per command; text-mode readline would wait forever on a hung worker.
        ready, _, _ = select.select([self.popen.stdout], [], [], WORKER_TIMEOUT_S)
        if not ready:
            self.popen.kill()
            raise RuntimeError(f"client worker did not answer {command!r} within {WORKER_TIMEOUT_S:.0f} s")
        line = self.popen.stdout.readline()
        if not line:
            raise RuntimeError(f"client worker exited with {self.popen.wait(timeout=30)} during {command!r}")
        return json.loads(line)

    def warm_up(self) -> list[float]:
        return list(self.request("warm"))  # type: ignore[arg-type]

    def run(self) -> RunSample:
        raw: dict = self.request("run")  # type: ignore[assignment]
        hops = [HopSample(tuple(hop.pop("blocks")), **hop) for hop in raw.pop("hops")]  # type: ignore[arg-type]
        return RunSample(**raw, hops=hops)

    def close(self) -> None:
        if self.popen.poll() is None:
            with contextlib.suppress(Exception):
                self.request("quit")
            try:
                self.popen.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout=10)


def client_worker(args: argparse.Namespace) -> None:
    """Serves `warm`, `run` and `quit` commands on stdin, answering each with one JSON line."""
    source = resolve_model(DEFAULT_MODEL)
    input_ids = fixed_prompt(source, args.prompt_tokens)
    model = DistributedModelForCausalLM.from_pretrained(
        DEFAULT_MODEL, initial_peers=args.initial_peers, client_config=ClientConfig(server_push=args.push)
    )
    try:
        for line in sys.stdin:
            command = line.strip()
            if command == "warm":
                with model.inference_session(max_length=input_ids.shape[1] + 4) as session:
                    model.generate(input_ids, session=session, **generate_kwargs(4))
                    answer: object = probe_noop_rtt(model, session)
            elif command == "run":
                answer = dataclasses.asdict(run_swarm(model, input_ids, args.max_new_tokens, args.root_pid))
            else:
                break
            print(json.dumps(answer), flush=True)
    finally:
        model.shutdown()


def measure_swarm(
    source: ModelSource,
    servers: int,
    local_model: AutoModelForCausalLM,
    input_ids: torch.Tensor,
    args: argparse.Namespace,
    workdir: Path,
) -> list[ConfigResult]:
    """Gives the swarm's results with and without push, each paired with local runs interleaved run for run."""
    ranges = even_block_ranges(source.num_blocks, servers)
    name = f"swarm {' '.join(ranges)}"
    started_s = time.perf_counter()
    pushes = (True, False) if args.compare_push else (True,)
    # Servers' own default announce period and TTL, so background DHT traffic is what a real swarm has. The servers
    # split the machine's cores between them, as the demo's do.
    threads = threads_per_server(servers)
    with SwarmProcesses(workdir, announce_period_s=10.0, record_ttl_s=30.0, torch_threads=threads) as swarm:
        swarm.start_dht()
        procs = [swarm.start_server(DEFAULT_MODEL, blocks, wait=False) for blocks in ranges]
        for proc in procs:
            swarm.wait_ready(proc)
        clients = {push: ClientProcess(swarm.initial_peers, push=push, args=args) for push in pushes}
        try:
            print(f"  {name}: up in {time.perf_counter() - started_s:.1f} s; warming up", flush=True)
            noop_rtt_ms: list[float] = []
            for client in clients.values():
                noop_rtt_ms = client.warm_up()
            swarm_runs: dict[bool, list[RunSample]] = {push: [] for push in pushes}
            local_runs: list[RunSample] = []
            one_thread_runs: list[RunSample] = []
            for repeat in range(args.repeats):
                local_runs.append(run_local(local_model, input_ids, args.max_new_tokens))
                with torch_threads(1):
                    one_thread_runs.append(run_local(local_model, input_ids, args.max_new_tokens))
                for push, client in clients.items():
                    swarm_runs[push].append(client.run())
                latest = [local_runs[-1], *(runs[-1] for runs in swarm_runs.values())]
                speeds = ", ".join(
                    f"{'push' if push else 'no push'} {runs[-1].decode_tokens_per_s:.1f} tok/s"
                    for push, runs in swarm_runs.items()
                )
                print(
                    f"  {name}: run {repeat + 1}/{args.repeats}: local {local_runs[-1].decode_tokens_per_s:.1f} tok/s "
                    f"(1 thread {one_thread_runs[-1].decode_tokens_per_s:.1f}), {speeds}; "
                    f"others' CPU up to {max(run.others_cpu_pct for run in latest):.0f}%",
                    flush=True,
                )
        finally:
            for client in clients.values():
                client.close()
    local = ConfigResult("local HF", 0, local_runs)
    one_thread = ConfigResult("local HF, 1 thread", 0, one_thread_runs)
    return [
        ConfigResult(name, servers, runs, noop_rtt_ms, local, one_thread, threads, push=push)
        for push, runs in swarm_runs.items()
    ]


def measure_local_alone(
    local_model: AutoModelForCausalLM, input_ids: torch.Tensor, args: argparse.Namespace
) -> ConfigResult:
    runs = []
    for repeat in range(args.repeats):
        runs.append(run_local(local_model, input_ids, args.max_new_tokens))
        print(
            f"  local: run {repeat + 1}/{args.repeats}: {runs[-1].decode_tokens_per_s:.1f} tok/s, "
            f"TTFT {runs[-1].ttft_ms:.0f} ms; others' CPU {runs[-1].others_cpu_pct:.0f}%",
            flush=True,
        )
    return ConfigResult("local HF", 0, runs)


def print_header(source: ModelSource, args: argparse.Namespace) -> None:
    load = ", ".join(f"{value:.2f}" for value in os.getloadavg())
    print(f"# chainswarm overhead benchmark, {datetime.datetime.now().isoformat(timespec='seconds')}")
    print(f"model: {DEFAULT_MODEL} ({source.num_blocks} blocks, hidden {source.config.hidden_size}), float32, CPU")
    print(
        f"machine: {platform.platform()}, {platform.processor() or platform.machine()}, "
        f"cpu_count={os.cpu_count()}, torch {torch.__version__}, torch.get_num_threads()={torch.get_num_threads()}"
    )
    print(f"python: {platform.python_version()}; loadavg at start (1, 5, 15 min): {load}")
    print(
        f"prompt {args.prompt_tokens} tokens, {args.max_new_tokens} new tokens (greedy), "
        f"median of {args.repeats} repeats after one warm-up generate; each swarm run is paired with a local run "
        f"just before it, and its ratio is against those paired local runs"
    )
    print(flush=True)


def label(result: ConfigResult) -> str:
    if result.push is None:
        return result.name
    return f"{result.name}{'' if result.push else ' (no push)'}"


def print_table(local: ConfigResult, one_thread: ConfigResult | None, results: list[ConfigResult]) -> None:
    header = [
        "config",
        "servers",
        "TTFT ms",
        "decode tok/s",
        "ratio vs local",
        "vs local 1 thread",
        "ms/token",
        "servers' compute",
        "network + loop",
        "client",
        "tokens match",
    ]
    local_ms = 1000 / local.decode_tokens_per_s
    rows = [[local.name, "-", f"{local.ttft_ms:.0f}", f"{local.decode_tokens_per_s:.1f}", "1.00", "-",
             f"{local_ms:.1f}", "-", "-", "-", "-"]]
    local_tokens = local.runs[0].tokens
    if one_thread is not None:
        rows.append([
            one_thread.name, "-", f"{one_thread.ttft_ms:.0f}", f"{one_thread.decode_tokens_per_s:.1f}",
            f"{one_thread.decode_tokens_per_s / local.decode_tokens_per_s:.2f}", "1.00",
            f"{1000 / one_thread.decode_tokens_per_s:.1f}", "-", "-", "-",
            "yes" if all(run.tokens == local_tokens for run in one_thread.runs) else "NO",
        ])
    for result in results:
        if result.error is not None:
            rows.append([label(result), str(result.servers), "error", *["-"] * 8])
            continue
        token_ms, compute_ms, network_ms, client_ms = decode_step_parts(result)
        match = all(run.tokens == local_tokens for run in result.runs)
        rows.append(
            [
                label(result),
                str(result.servers),
                f"{result.ttft_ms:.0f}",
                f"{result.decode_tokens_per_s:.1f}",
                f"{result.ratio_vs_local:.2f}",
                f"{result.ratio_vs_local_one_thread:.2f}",
                f"{token_ms:.1f}",
                f"{compute_ms:.1f}",
                f"{network_ms:.1f}",
                f"{client_ms:.1f}",
                "yes" if match else "NO",
            ]
        )
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |")


def decode_step_parts(result: ConfigResult) -> tuple[float, float, float, float]:
    """Gives a decode token's ms in the median run: total, servers' compute, network + loops, client.

    The swarm step's wall time (client's view) minus the servers' compute is what the network legs, the RPC stacks
    and the event loops cost; the rest of the token's time is the client's (embedding, LM head, generate()).
    """
    run = result.median_run()
    token_ms = 1000 / run.decode_tokens_per_s
    compute_ms = sum(hop.compute_ms / hop.steps for hop in run.hops)
    return token_ms, compute_ms, run.step_ms - compute_ms, token_ms - run.step_ms


def print_breakdown(results: list[ConfigResult]) -> None:
    """Prints where a swarm decode step's time goes: per server, and the client's share."""
    print()
    print("where a decode token goes, median run (ms/token):")
    for result in results:
        if result.error is not None:
            print(f"  {label(result)}: {result.error}")
            continue
        token_ms, compute_ms, network_ms, client_ms = decode_step_parts(result)
        print(
            f"  {label(result)}: {token_ms:.1f} = servers' compute {compute_ms:.1f} + network, RPC and loops "
            f"{network_ms:.1f} + client (embed, head, generate) {client_ms:.1f}; session open {result.open_ms:.0f} ms "
            f"(not in TTFT); servers on {result.torch_threads or 'torch default'} thread(s) each; "
            f"others' CPU up to {result.others_cpu_max_pct:.0f}%"
        )
        if result.paired_local is not None:
            local_run = result.paired_local.median_run()
            local_ms = 1000 / local_run.decode_tokens_per_s
            print(
                f"    local alongside, median run: {local_ms:.1f} = blocks {local_run.body_ms:.1f} "
                f"+ head, generate {local_ms - local_run.body_ms:.1f}"
            )
        for ((start, end), rtt, compute), noop in zip(result.hops(), result.noop_rtt_ms, strict=False):
            print(
                f"    blocks {start}:{end}: server compute {compute:.1f}, client's call {rtt:.1f} "
                f"(with push, the call starts after the server began); no-op `info` rtt {noop:.1f}"
            )


def print_verdict(results: list[ConfigResult]) -> None:
    target = next((r for r in results if r.servers == TARGET_SERVERS and r.error is None and r.push), None)
    goal = f"{TARGET_SERVERS}-server swarm reaches >= {TARGET_RATIO}x local decode tokens/s"
    print()
    if target is None:
        print(f"verdict: NOT MEASURED: {goal} (no {TARGET_SERVERS}-server result)")
        return
    ratio = target.ratio_vs_local
    status = "PASS" if ratio >= TARGET_RATIO else "FAIL"
    busy = target.others_cpu_max_pct
    caveat = ""
    if busy > BUSY_MACHINE_PCT:
        caveat = f"; UNRELIABLE: other processes used up to {busy:.0f}% of the CPUs meanwhile, rerun on a quiet machine"
    print(
        f"verdict: {status}: {goal}: measured {ratio:.2f}x "
        f"({target.decode_tokens_per_s:.1f} vs {target.decode_tokens_per_s / ratio:.1f} tok/s paired local){caveat}"
    )
    print(
        f"  against the local model on one torch thread, measured alongside: {target.ratio_vs_local_one_thread:.2f}x "
        f"(the target's baseline is the local model as Hugging Face runs it, on torch's default threads)"
    )
    for pushed in results:
        unpushed = next((r for r in results if r.servers == pushed.servers and r.push is False and not r.error), None)
        if pushed.push and pushed.error is None and unpushed is not None:
            gain = pushed.decode_tokens_per_s / unpushed.decode_tokens_per_s
            print(f"  {pushed.servers} server(s): push gives {gain:.2f}x the decode tokens/s of no push")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-new-tokens", type=int, default=48, help="tokens generated per timed run")
    parser.add_argument("--prompt-tokens", type=int, default=32, help="length of the fixed prompt")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per configuration (median reported)")
    parser.add_argument("--servers", default="1,2,3", help="comma-separated swarm sizes to measure")
    parser.add_argument(
        "--no-compare-push", dest="compare_push", action="store_false",
        help="measure only with server-to-server push (default: also without it, side by side)",
    )
    # The swarm clients run as workers of this script (see ClientProcess).
    parser.add_argument("--client-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--initial-peers", nargs="*", default=[], help=argparse.SUPPRESS)
    parser.add_argument("--push", action=argparse.BooleanOptionalAction, default=True, help=argparse.SUPPRESS)
    parser.add_argument("--root-pid", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.server_counts = [int(part) for part in args.servers.split(",") if part.strip()]
    if args.max_new_tokens < 3 or args.prompt_tokens < 1 or args.repeats < 1:
        parser.error("need --max-new-tokens >= 3, --prompt-tokens >= 1 and --repeats >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.client_worker:
        client_worker(args)
        return
    source = resolve_model(DEFAULT_MODEL)
    input_ids = fixed_prompt(source, args.prompt_tokens)
    print_header(source, args)
    local_model = AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.float32).eval()
    run_local(local_model, input_ids, 4)  # warm-up
    results = []
    with tempfile.TemporaryDirectory(prefix="chainswarm-bench-") as tmp:
        for servers in args.server_counts:
            workdir = Path(tmp) / f"swarm-{servers}"
            workdir.mkdir()
            try:
                results.extend(measure_swarm(source, servers, local_model, input_ids, args, workdir))
            except Exception as error:  # one failed configuration should not hide the others' numbers
                message = f"{type(error).__name__}: {str(error)[-500:]}"
                print(f"  {servers} server(s) failed: {message}", flush=True)
                results.append(ConfigResult(f"swarm x{servers}", servers, [], error=message))
    local_runs = [run for result in results if result.paired_local for run in result.paired_local.runs]
    local = ConfigResult("local HF", 0, local_runs or measure_local_alone(local_model, input_ids, args).runs)
    one_thread_runs = [
        run for result in results if result.paired_local_one_thread for run in result.paired_local_one_thread.runs
    ]
    one_thread = ConfigResult("local HF, 1 thread", 0, one_thread_runs) if one_thread_runs else None
    print()
    print_table(local, one_thread, results)
    print_breakdown(results)
    print_verdict(results)
    print(f"loadavg at end (1, 5, 15 min): {', '.join(f'{value:.2f}' for value in os.getloadavg())}")


if __name__ == "__main__":
    main()
