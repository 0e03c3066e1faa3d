"""The client side of `benchmarks/table1.py` and `benchmarks/mell_live.py`: replays a request list against a swarm,
one thread per request.

    python benchmarks/table1_client.py --model PATH --initial-peers MADDR... --requests REQ.json --out OUT.jsonl
        [--orchestrator auto|none] [--dilation F] [--busy-wait S]

Each request `{id, at_s, prompt_tokens, output_tokens}` starts `at_s` after the replay starts: it opens a session
(through the orchestrator's JFFC queue, or by routing over DHT records with Petals' retry and exponential backoff
while no server has room, its delays stretched by the run's time dilation) and generates exactly `output_tokens`
greedy tokens. One JSON line per request: `{id, arrival_s, arrival_wall, started_s, first_token_s, ended_s,
closed_s, tokens, failovers, moves, first_route, open_attempts, route, chain_follows, spans, error}`: waiting =
started - arrival, service = ended - started (its first token at first_token_s, its last at ended_s; the session
closed, its servers and lease released, at closed_s); `tokens` the generated ids; `first_route` is the chain the
session opened on (`open_attempts`: how, as [kind, started_s, ended_s, peer_id, outcome] per route, `open` call and
back-off), `route` the one it ended on (`chain_follows`: [started_s, ended_s, followed] each time a step learned that
a drop or restore changed it, and followed it or replayed); `spans` the client's timings per server (steps, summed
round trips, and the compute time of the batches the server reported); `arrival_wall` is the arrival by the wall
clock. With `--servers-out`, each server's batch statistics at the end.
Prints `ready` once connected and `done` at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from client import ClientConfig, DistributedModelForCausalLM
from client.swarm_client import SwarmClient
from swarm.errors import NoRouteFound, PeerUnreachable, RpcTimeout, ServerBusy, SwarmError

if TYPE_CHECKING:
    from netem.network import EmulatedNetwork

START_DELAY_S = 2.0
MAX_WAIT_S = 1200.0  # a request that found no room this long is recorded as an error (no run hangs on one)
BACKOFF_FIRST_S, BACKOFF_MAX_S = 0.5, 8.0  # Petals' client retries a full swarm with exponential backoff (emulated s)


class _FirstToken:
    """A `generate()` streamer that notes when the first new token arrives (its first `put` is the prompt)."""

    def __init__(self) -> None:
        self.puts = 0
        self.at: float | None = None

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1
        if self.puts == 2:
            self.at = time.perf_counter()

    def end(self) -> None:
        pass


def _since(stamp: float | None, started_at: float) -> float | None:
    return None if stamp is None else stamp - started_at


def serve_request(model: DistributedModelForCausalLM, request: dict, started_at: float, out, lock,
                  dilation: float) -> None:
    arrival_s = time.perf_counter() - started_at
    prompt, output = int(request["prompt_tokens"]), int(request["output_tokens"])
    input_ids = torch.randint(3, model.config.vocab_size, (1, prompt),
                              generator=torch.Generator().manual_seed(int(request["id"])))
    record: dict = {"id": request["id"], "arrival_s": arrival_s, "arrival_wall": time.time()}
    backoff_s = BACKOFF_FIRST_S * dilation
    try:
        while True:
            try:
                session = model.inference_session(max_length=prompt + output, prompt_tokens=prompt)
                break
            except (NoRouteFound, ServerBusy, RpcTimeout, PeerUnreachable):  # as Petals' client: back off, retry
                if time.perf_counter() - started_at - arrival_s > MAX_WAIT_S:
                    raise
                time.sleep(backoff_s)
                backoff_s = min(BACKOFF_MAX_S * dilation, backoff_s * 2)
        record["started_s"] = time.perf_counter() - started_at
        record["first_route"] = [span.peer_id for span in session.route]
        record["open_attempts"] = [[a.kind, a.started_s - started_at, a.ended_s - started_at, a.peer_id, a.outcome]
                                   for a in session.open_attempts]
        first_token = _FirstToken()
        with session:
            generated = model.generate(input_ids, session=session, max_new_tokens=output, min_new_tokens=output,
                                       do_sample=False, streamer=first_token)
            record["ended_s"] = time.perf_counter() - started_at  # the last token is the user's: the response ends
            if first_token.at is not None:
                record["first_token_s"] = first_token.at - started_at
            record["tokens"] = generated[0, prompt:].tolist()  # greedy: arms compare them request by request
            record["failovers"] = session.failovers
            record["moves"] = session.moves
            record["route"] = [span.peer_id for span in session.route]
            record["chain_follows"] = [[f.started_s - started_at, f.ended_s - started_at, f.followed]
                                       for f in session.chain_follows]
            record["spans"] = [{"peer_id": span.peer_id, "steps": span.steps, "round_trip_ms": span.round_trip_ms,
                                "compute_ms": span.compute_ms, "first_sent_s": _since(span.first_sent_s, started_at),
                                "first_received_s": _since(span.first_received_s, started_at)}
                               for span in session.timings()]
            record["client_steps"] = {name: value for name, value in dataclasses.asdict(session.step_times).items()
                                      if name != "head_returned_s"}
        record["closed_s"] = time.perf_counter() - started_at  # the session closed (and its lease released)
    except Exception as error:  # recorded, the replay goes on
        record["error"] = f"{type(error).__name__}: {error}"
    with lock:
        out.write(json.dumps(record) + "\n")
        out.flush()


def run_replay(network: EmulatedNetwork, initial_peers: list[str], model: str, requests: Path, out: Path,
               log_dir: Path, timeout_s: float, *options: str) -> None:
    """Runs this client in `network`'s host "client" on `requests` (plus `options`) until it printed `done`."""
    client = network.spawn(
        "client", [sys.executable, str(Path(__file__).resolve()), "--model", model, "--initial-peers", *initial_peers,
                   "--requests", str(requests), "--out", str(out), *options],
        name="client", log_dir=log_dir, env={"OMP_WAIT_POLICY": "PASSIVE"},
    )
    try:
        client.wait_for_line("ready", 300)
        client.wait_for_line("done", timeout_s)
    finally:
        client.stop()


def trace_requests(path: Path, count: int, rate_per_s: float, *, offset: int = 0, prompt_scale: float = 1.0,
                   output_scale: float = 1.0, max_tokens: int) -> list[dict]:
    """Gives `count` requests of an Azure LLM trace from request `offset`, as this client replays them: prompt and
    output lengths divided by their scales and cut to `max_tokens` in all (the output kept, the prompt shortened),
    arrival times stretched to `rate_per_s` on average (the trace's burstiness kept)."""
    from orchestrator.sim.workload import load_azure_trace

    trace = load_azure_trace(path)
    seconds = trace.seconds[offset : offset + count] - trace.seconds[offset]
    native = (count - 1) / float(seconds[-1])
    requests = []
    for index in range(count):
        output = max(1, min(max_tokens - 1, round(trace.generated_tokens[offset + index] / output_scale)))
        prompt = max(1, min(max_tokens - output, round(trace.context_tokens[offset + index] / prompt_scale)))
        requests.append({"id": index, "at_s": float(seconds[index] * native / rate_per_s), "prompt_tokens": prompt,
                         "output_tokens": output})
    return requests


async def server_batches(swarm: SwarmClient) -> dict[str, dict]:
    """Gives each online server's batch statistics (`info`'s `batches`), by peer id."""
    stats: dict[str, dict] = {}
    for peer_id, record in (await swarm.servers()).items():
        try:
            connection = await swarm.connect(record)
            stats[peer_id] = (await connection.call("info", {}, timeout=30.0))["batches"]
        except SwarmError as error:
            stats[peer_id] = {"error": error.message}
    return stats


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--initial-peers", nargs="+", required=True)
    parser.add_argument("--requests", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--servers-out", type=Path, help="where to write each server's batch statistics at the end")
    parser.add_argument("--orchestrator", default="auto")
    parser.add_argument("--dilation", type=float, default=1.0, help="the swarm's time dilation: backoffs stretch too")
    parser.add_argument("--busy-wait", type=float, default=0.0,
                        help="ClientConfig.busy_wait_s: 0 leaves a full swarm's retries to this script's own backoff")
    args = parser.parse_args()
    requests = json.loads(args.requests.read_text())
    config = ClientConfig(orchestrator=None if args.orchestrator == "none" else args.orchestrator,
                          request_timeout_s=600.0, orchestrator_queue_timeout_s=3600.0, max_failovers=16,
                          busy_wait_s=args.busy_wait)
    model = DistributedModelForCausalLM.from_pretrained(args.model, initial_peers=args.initial_peers,
                                                        client_config=config)
    print("ready", flush=True)
    lock = threading.Lock()
    threads = []
    with args.out.open("w") as out:
        started_at = time.perf_counter() + START_DELAY_S
        for request in requests:
            delay_s = started_at + float(request["at_s"]) - time.perf_counter()
            if delay_s > 0:
                time.sleep(delay_s)
            thread = threading.Thread(target=serve_request, args=(model, request, started_at, out, lock, args.dilation),
                                  daemon=True)
            thread.start()
            threads.append(thread)
        for thread in threads:
            thread.join()
    if args.servers_out:
        args.servers_out.write_text(json.dumps(model.swarm.run(server_batches(model.swarm), timeout=120)))
    print("done", flush=True)
    model.shutdown()


if __name__ == "__main__":
    main()
