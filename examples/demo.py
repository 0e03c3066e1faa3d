"""`swarm-demo`: a local swarm of three SmolLM2-135M-Instruct servers on 127.0.0.1 answers one chat question.

Starts a DHT bootstrap and three `swarm-server` processes (blocks 0:10, 10:20, 20:30), generates one greedy reply
through them, prints it with tokens/s, time to first token and a per-server timing table, and shuts everything
down (also on Ctrl-C).

    .venv/bin/python -m examples.demo [--question "..."] [--max-new-tokens 48] [--keep-logs]
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase, TextStreamer

from client import DistributedModelForCausalLM, InferenceSession, SpanTimings
from swarm.local_swarm import SwarmProcesses, threads_per_server
from swarm.model import DEFAULT_MODEL, resolve_model

BLOCK_RANGES = ("0:10", "10:20", "20:30")
DEFAULT_QUESTION = "What is the capital of France?"


class TimedStreamer(TextStreamer):
    """Prints the reply as it comes; at the first generated token, stamps the time and snapshots the timings.

    `generate()` puts the prompt first, then each token right after the step that produced it, so the snapshot
    taken at the first generated token holds exactly the prefill step of every server.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, session: InferenceSession) -> None:
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.session = session
        self.first_token_s: float | None = None
        self.prefill: dict[str, SpanTimings] = {}

    def put(self, value: torch.Tensor) -> None:
        if self.first_token_s is None and not self.next_tokens_are_prompt:
            self.first_token_s = time.perf_counter()
            self.prefill = {span.peer_id: dataclasses.replace(span) for span in self.session.timings()}
        super().put(value)


def build_parser() -> argparse.ArgumentParser:
    """Gives the argument parser of swarm-demo."""
    parser = argparse.ArgumentParser(prog="swarm-demo", description=__doc__.splitlines()[0])
    parser.add_argument("--question", default=DEFAULT_QUESTION, help="the user turn to answer")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="longest reply in tokens (default: 48)")
    parser.add_argument("--keep-logs", action="store_true", help="keep the processes' log folder after exit")
    return parser


def start_swarm(swarm: SwarmProcesses) -> None:
    """Starts the bootstrap node, then the three servers in parallel, and waits until all of them serve."""
    swarm.start_dht()
    servers = [
        swarm.start_server(DEFAULT_MODEL, blocks, "--public-name", f"demo-{index}", name=f"demo-{index}", wait=False)
        for index, blocks in enumerate(BLOCK_RANGES)
    ]
    for server in servers:
        swarm.wait_ready(server)


def timing_table(timings: list[SpanTimings], prefill: dict[str, SpanTimings]) -> str:
    """Gives one row per server (its prefill step, then the mean decode step) and a line that splits a decode step
    into the servers' compute and the rest (network, RPC, event loops)."""
    header = ("server", "blocks", "prefill output at/compute ms", "decode steps", "output at ms/step",
              "compute ms/step")
    rows = [header]
    last_output_ms = total_compute_ms = 0.0
    for span in timings:
        first = prefill.get(span.peer_id, SpanTimings(span.peer_id, span.blocks, span.public_name))
        steps = max(span.steps - first.steps, 1)
        output_at_ms = (span.output_at_ms - first.output_at_ms) / steps
        compute_ms = (span.compute_ms - first.compute_ms) / steps
        last_output_ms, total_compute_ms = max(last_output_ms, output_at_ms), total_compute_ms + compute_ms
        rows.append((
            f"{span.public_name or '-'} ({span.peer_id[-8:]})",
            f"{span.blocks[0]}:{span.blocks[1]}",
            f"{first.output_at_ms:.0f} / {first.compute_ms:.0f}",
            str(span.steps - first.steps),
            f"{output_at_ms:.1f}",
            f"{compute_ms:.1f}",
        ))
    widths = [max(len(row[column]) for row in rows) for column in range(len(header))]
    lines = [
        "  ".join(cell.ljust(width) if column < 2 else cell.rjust(width)
                  for column, (cell, width) in enumerate(zip(row, widths, strict=True)))
        for row in rows
    ]
    lines.insert(1, "  ".join("-" * width for width in widths))
    rest_ms = last_output_ms - total_compute_ms
    lines.append(f"a decode step through the chain: {last_output_ms:.1f} ms = servers' compute "
                 f"{total_compute_ms:.1f} ms + network, RPC and event loops {rest_ms:.1f} ms")
    return "\n".join(lines)


def chat_once(
    model: DistributedModelForCausalLM, tokenizer: PreTrainedTokenizerBase, question: str, max_new_tokens: int
) -> None:
    """Generates one greedy reply to `question` through the swarm and prints it with its timings."""
    encoded = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, return_tensors="pt"
    )
    input_ids = encoded if isinstance(encoded, torch.Tensor) else encoded["input_ids"]
    prompt_tokens = input_ids.shape[1]
    print(f"\nuser: {question}\nassistant: ", end="", flush=True)
    opened = time.perf_counter()
    with model.inference_session(max_length=prompt_tokens + max_new_tokens) as session:
        streamer = TimedStreamer(tokenizer, session)
        started = time.perf_counter()
        output = model.generate(
            input_ids, session=session, max_new_tokens=max_new_tokens, do_sample=False, streamer=streamer,
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
        )
        finished = time.perf_counter()
        route, timings = session.route, session.timings()
    new_tokens = output.shape[1] - prompt_tokens
    hops = [f"{span.record.public_name or span.peer_id}[{span.start}:{span.end}]" for span in route]
    print(f"\n\nroute: {' -> '.join(hops)}  (session opened in {(started - opened) * 1000:.0f} ms)")
    print(f"{new_tokens} new tokens from a {prompt_tokens}-token prompt in {finished - started:.2f} s "
          f"({new_tokens / (finished - started):.1f} tokens/s overall)")
    if streamer.first_token_s is not None:
        print(f"time to first token: {(streamer.first_token_s - started) * 1000:.0f} ms (prefill + LM head)")
        if new_tokens > 1:
            print(f"decode: {(new_tokens - 1) / (finished - streamer.first_token_s):.1f} tokens/s after the first")
    print("\nper server (output at = from the step's start until the server's output reached the client; compute = "
          "the server's own time for its blocks):")
    print(timing_table(timings, streamer.prefill))


def run(args: argparse.Namespace, log_dir: Path) -> None:
    """Starts the swarm, chats once, and always stops the client before the processes."""
    print(f"Resolving {DEFAULT_MODEL} (converted into the local cache once, then reused) ...", flush=True)
    source = resolve_model(DEFAULT_MODEL)
    print(f"Checkpoint: {source.path}\nProcess logs: {log_dir}")
    with SwarmProcesses(log_dir, torch_threads=threads_per_server(len(BLOCK_RANGES))) as swarm:
        try:
            started = time.perf_counter()
            print(f"Starting a DHT bootstrap and {len(BLOCK_RANGES)} servers (blocks {', '.join(BLOCK_RANGES)}) ...",
                  flush=True)
            start_swarm(swarm)
            print(f"Swarm ready in {time.perf_counter() - started:.1f} s; "
                  f"initial peers: {' '.join(swarm.initial_peers)}")
            model = DistributedModelForCausalLM.from_pretrained(DEFAULT_MODEL, initial_peers=swarm.initial_peers)
            try:
                tokenizer = AutoTokenizer.from_pretrained(source.path)
                chat_once(model, tokenizer, args.question, args.max_new_tokens)
            finally:
                model.shutdown()
        finally:
            print("\nShutting down the swarm ...", flush=True)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the swarm-demo console script; gives the exit code."""
    args = build_parser().parse_args(argv)
    if args.max_new_tokens <= 0:
        raise SystemExit("swarm-demo: error: --max-new-tokens must be positive")
    log_dir = Path(tempfile.mkdtemp(prefix="chainswarm-demo-"))
    keep_logs = args.keep_logs
    try:
        run(args, log_dir)
    except KeyboardInterrupt:
        print("\nInterrupted; the swarm is shut down.", file=sys.stderr)
        return 130
    except BaseException:
        keep_logs = True  # the logs are what explains the failure
        raise
    finally:
        if keep_logs:
            print(f"Logs kept in {log_dir}", file=sys.stderr)
        else:
            shutil.rmtree(log_dir, ignore_errors=True)
    print("Done.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
