"""The monitor side of `benchmarks/mell_live.py`: polls every server of a model with `info`, as fast as `--period`.

    python benchmarks/mell_live_monitor.py --model PATH --initial-peers MADDR... --servers N --out OUT.jsonl
        [--period 0.5]

Waits until the DHT shows `--servers` servers, prints `ready`, then writes one JSON line per server and poll:
`{t (wall clock), peer_id, pages_kv, sessions, accepting, capacity_pages (its pool less its parameters), blocks,
kv_tokens_per_page, kv_bytes_per_token (one block's), prefill_ms_per_token (one block's), network_mbps, migrations
(info's), packing (info's), block_start, block_end, pages_total, pages_params, pages_free, block_compute_ms,
block_decode_ms, dropping (info's), batches (info's: batches, compute_ms, cpu_ms, prefill_tokens, prefill_batches,
prefill_batch_ms, prefill_batch_cpu_ms)}` until its standard input closes or says `quit`; prints `done`. A server
that does not answer is skipped for that poll.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from client.swarm_client import SwarmClient
from swarm.errors import SwarmError
from swarm.model import resolve_model
from swarm.records import ServerRecord
from swarm.rpc import RpcConnection

if TYPE_CHECKING:
    from netem.network import EmulatedNetwork
    from netem.processes import HostProcess

READY_TIMEOUT_S = 300.0
CALL_TIMEOUT_S = 10.0


def spawn_monitor(network: EmulatedNetwork, model: str, initial_peers: list[str], servers: int, out: Path,
                  period_s: float, log_dir: Path) -> HostProcess:
    """Starts this monitor in `network`'s host "mon"; it has printed `ready` when this returns (stop it with
    `send_line("quit")` and `stop()`)."""
    monitor = network.spawn("mon", [sys.executable, str(Path(__file__).resolve()), "--model", model,
                                    "--initial-peers", *initial_peers, "--servers", str(servers), "--out", str(out),
                                    "--period", str(period_s)],
                            name="monitor", log_dir=log_dir, interactive=True, env={"OMP_WAIT_POLICY": "PASSIVE"})
    try:
        monitor.read_line(READY_TIMEOUT_S)
    except BaseException:
        monitor.stop()
        raise
    return monitor


async def poll_once(swarm: SwarmClient, connections: dict[str, RpcConnection], records: dict[str, ServerRecord]
                    ) -> list[dict]:
    async def one(peer_id: str) -> dict | None:
        try:
            connection = connections.get(peer_id)
            if connection is None or connection.is_closed:
                connection = connections[peer_id] = await swarm.connect(records[peer_id])
            reply = await connection.call("info", {}, timeout=CALL_TIMEOUT_S)
        except SwarmError:
            connections.pop(peer_id, None)
            return None
        record = reply["record"]
        return {"t": time.time(), "peer_id": peer_id, "pages_kv": record["pages_kv"],
                "sessions": record["session_count"], "accepting": record["accepting"],
                "capacity_pages": record["pages_total"] - record["pages_params"],
                "blocks": record["block_end"] - record["block_start"],
                "kv_tokens_per_page": reply["kv_tokens_per_page"], "kv_bytes_per_token": record["kv_bytes_per_token"],
                "prefill_ms_per_token": record["block_prefill_ms_per_token"], "network_mbps": record["network_mbps"],
                "migrations": reply["migrations"], "packing": reply["packing"],
                "block_start": record["block_start"], "block_end": record["block_end"],
                "pages_total": record["pages_total"], "pages_params": record["pages_params"],
                "pages_free": record["pages_free"], "block_compute_ms": record["block_compute_ms"],
                "block_decode_ms": record["block_decode_ms"], "dropping": reply.get("dropping"),
                "batches": {key: reply["batches"][key] for key in ("batches", "compute_ms", "cpu_ms", "prefill_tokens",
                                                                    "prefill_batches", "prefill_batch_ms",
                                                                    "prefill_batch_cpu_ms", "joined", "passed",
                                                                    "mixed")},
                # decode steps' latency on the server, from admission to their batch's end (count, mean, max so far)
                "decode_step_ms": reply["batches"]["decode_step_ms"]}

    results = await asyncio.gather(*(one(peer_id) for peer_id in sorted(records)))
    return [result for result in results if result is not None]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--initial-peers", nargs="+", required=True)
    parser.add_argument("--servers", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--period", type=float, default=0.5)
    args = parser.parse_args()
    source = resolve_model(args.model)
    swarm = SwarmClient(source.model_id, source.num_blocks, args.initial_peers)
    deadline = time.monotonic() + READY_TIMEOUT_S
    records = swarm.run(swarm.servers())
    while len(records) < args.servers and time.monotonic() < deadline:
        time.sleep(1.0)
        records = swarm.run(swarm.servers())
    print("ready", flush=True)
    stop = threading.Event()

    def watch_stdin() -> None:
        for line in sys.stdin:
            if line.strip() == "quit":
                break
        stop.set()

    threading.Thread(target=watch_stdin, daemon=True).start()
    connections: dict[str, RpcConnection] = {}
    with args.out.open("w") as out:
        while not stop.is_set():
            started = time.monotonic()
            for row in swarm.run(poll_once(swarm, connections, records), timeout=60):
                out.write(json.dumps(row) + "\n")
            out.flush()
            stop.wait(max(0.0, args.period - (time.monotonic() - started)))
    for connection in connections.values():
        swarm.run(connection.close(), timeout=10)
    print("done", flush=True)
    swarm.shutdown()


if __name__ == "__main__":
    main()
