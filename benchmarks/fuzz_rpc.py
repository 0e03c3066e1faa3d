"""A long fuzz of every RPC method of a live server (the suite's `tests/test_fuzz_rpc.py` runs a few hundred calls):
`--frames` random payloads per method: half of them a well-formed payload of the method with one or two fields changed
or dropped, half built from the fields the methods read and filled with values of every wire type, tensors of random
shapes and dtypes among them; then raw frames of random bytes on fresh streams.

Printed: per method, how many calls it took, how many answered a result, and the typed errors that came back by
code; the untyped ones (`InternalServerError`, or a code the client does not know), which must be none; the
server's pages free before and after (once the fuzzer's sessions and imports expired: no page may leak); whether the
server still serves; and its RSS before and after.

    .venv/bin/python benchmarks/fuzz_rpc.py [--frames 10000] [--seed 0]

Loopback only. Never asserts.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import platform
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import torch

from client.swarm_client import SwarmClient
from swarm.errors import InternalServerError, RemoteError, SwarmError
from swarm.local_swarm import SwarmProcesses
from swarm.model import DEFAULT_MODEL, resolve_model
from swarm.rpc import PROTOCOL
from swarm.wire import encode_tensor
from tests.test_fuzz_rpc import FIELDS, METHODS  # the same methods and fields as the suite's fuzzer

WORDS = ("0:8", "fp16", "bf16", "last", "all", "kv", "replay", "auto", "", "a" * 200)
SETTLE_S = 30.0
RAW_REPLY_S = 2.0


class Payloads:
    """Random payloads: a few fields each, values of every wire type, sometimes valid-looking."""

    def __init__(self, seed: int, session_ids: list[str]) -> None:
        self.rng = random.Random(seed)
        self.session_ids = session_ids  # ids of sessions the fuzzer opened, so that some calls reach a session

    def value(self, depth: int = 0) -> Any:
        rng = self.rng
        kind = rng.randrange(12 if depth < 2 else 9)
        if kind == 0:
            return None
        if kind == 1:
            return rng.random() < 0.5
        if kind == 2:
            return rng.choice([rng.randint(-2, 70), rng.randint(-(2**63), 2**63 - 1)])
        if kind == 3:
            return rng.choice([rng.uniform(-1e9, 1e9), float("nan"), float("inf")])
        if kind == 4:
            return rng.choice(WORDS + tuple(self.session_ids or ["x"]))
        if kind == 5:
            return rng.randbytes(rng.randrange(64))
        if kind == 6:
            shape = [rng.randrange(10) for _ in range(rng.randrange(5))]
            dtype = rng.choice([torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool])
            return encode_tensor(torch.zeros(shape, dtype=dtype))
        if kind == 7:
            return {"dtype": rng.choice(["float32", "int8", "x"]), "data": rng.randbytes(rng.randrange(32)),
                    "shape": [rng.randint(-3, 2**40) for _ in range(rng.randrange(4))]}
        if kind == 8:
            return [rng.randint(-1, 9), rng.randint(-1, 9)]
        if kind == 9:
            return [self.value(depth + 1) for _ in range(rng.randrange(4))]
        return {rng.choice(FIELDS): self.value(depth + 1) for _ in range(rng.randrange(4))}

    def payload(self, method: str) -> dict[str, Any]:
        """Half the time: the method's valid payload (`valid_payload`) with one or two fields changed or dropped;
        else a few random fields."""
        rng = self.rng
        if rng.random() < 0.5:
            return {rng.choice(FIELDS): self.value() for _ in range(rng.randrange(9))}
        payload = valid_payload(method, rng.choice(self.session_ids or ["none"]), rng)
        for _ in range(rng.randint(1, 2)):
            name = rng.choice(sorted(payload) or list(FIELDS))
            if rng.random() < 0.3:
                payload.pop(name, None)
            else:
                payload[name] = self.value()
        return payload


def valid_payload(method: str, session_id: str, rng: random.Random) -> dict[str, Any]:
    """Gives a well-formed payload of `method` for a server of SmolLM2's blocks 0:30 (hidden size 576, 3 KV heads
    of 64), about session `session_id`."""
    hidden = encode_tensor(torch.randn(1, rng.randint(1, 3), 576))
    kv = encode_tensor(torch.randn(3, 2, 64))
    return {
        "info": {}, "open": {"blocks": [0, 30], "max_length": 64},
        "step": {"session_id": session_id, "hidden": hidden, "step_id": str(rng.randrange(4)), "position": 0},
        "steps": {"steps": [{"session_id": session_id, "hidden": hidden}]},
        "push": {"session_id": session_id, "hidden": hidden, "step_id": "0", "position": 0},
        "close": {"session_id": session_id}, "assign": {"blocks": [0, 10]}, "drop": {"blocks": [0, 10]},
        "restore": {}, "migrate": {"session_id": session_id, "peer_id": "QmNotAPeer"},
        "import_open": {"session_id": session_id, "blocks": [0, 2], "batch": 1, "max_length": 64, "position": 2},
        "import_kv": {"session_id": session_id, "pieces": [{"block": 0, "row": 0, "start": 0, "keys": kv,
                                                            "values": kv}]},
        "import_commit": {"session_id": session_id, "position": 2}, "import_abort": {"session_id": session_id},
        "kv_report": {}, "export": {"session_id": session_id, "into": "x", "position": 0, "to": [0, 30]},
        "attend_open": {"session_id": session_id, "blocks": [0, 2], "batch": 1, "max_length": 64, "position": 2},
        "attend": {"session_id": session_id, "block": 0, "position": 0, "tokens": 1,
                   "queries": encode_tensor(torch.randn(1, 9, 64)), "keys": encode_tensor(torch.randn(1, 3, 64)),
                   "values": encode_tensor(torch.randn(1, 3, 64))},
        "attend_read": {"session_id": session_id, "block": 0, "start": 0, "end": 1},
        "attend_release": {"session_id": session_id},
    }[method]


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--frames", type=int, default=10_000, help="payloads per method")
    parser.add_argument("--raw", type=int, default=2_000, help="frames of random bytes, each on a fresh stream")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(f"fuzz_rpc: {args.frames} payloads per method, {args.raw} raw frames, seed {args.seed}; "
          f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC on {platform.node()} ({os.cpu_count()} cores)",
          flush=True)
    model_id = resolve_model(DEFAULT_MODEL).model_id
    with tempfile.TemporaryDirectory(prefix="fuzz-rpc-") as tmp, SwarmProcesses(Path(tmp)) as swarm:
        swarm.start_dht()
        server = swarm.start_server(DEFAULT_MODEL, "0:30", "--import-idle-timeout", "2", "--session-timeout", "5",
                                    "--memory", "1GB")
        client = SwarmClient(model_id, 30, swarm.initial_peers)
        try:
            record = client.run(client.servers())[server.peer_id]
            before_pages, before_rss = record.pages_free, rss_kb(server.popen.pid)
            outcomes: dict[str, Counter[str]] = {method: Counter() for method in METHODS}
            untyped: list[str] = []
            connection = client.run(client.connect(record))
            opened: list[str] = []
            payloads = Payloads(args.seed, opened)
            started = time.monotonic()
            for round_index in range(args.frames):
                for method in METHODS:
                    if connection.is_closed:
                        connection = client.run(client.connect(record))
                    payload = payloads.payload(method)
                    try:
                        reply = client.run(connection.call(method, payload, timeout=30.0))
                        outcomes[method]["ok"] += 1
                        if method == "open" and isinstance(reply.get("session_id"), str) and len(opened) < 64:
                            opened.append(reply["session_id"])
                    except SwarmError as error:
                        outcomes[method][error.code] += 1
                        if isinstance(error, InternalServerError | RemoteError):
                            untyped.append(f"{method}({payload!r:.200}): {error.code}: {error.message:.200}")
                if round_index % 1000 == 999:
                    print(f"  {round_index + 1} rounds in {time.monotonic() - started:.0f} s", flush=True)
            client.run(connection.close())
            raw_outcomes: Counter[str] = Counter()
            rng = random.Random(args.seed + 1)
            for _ in range(args.raw):
                raw_outcomes[client.run(_send_raw(client, record, rng.randbytes(rng.randrange(1, 256))))] += 1
            deadline = time.monotonic() + SETTLE_S
            while time.monotonic() < deadline:
                after = client.run(client.servers()).get(server.peer_id)
                if after is not None and after.pages_free == before_pages:
                    break
                time.sleep(1.0)
            after_rss = rss_kb(server.popen.pid)
            print("\n| method | calls | ok | typed errors (code: count) |\n|---|---|---|---|")
            for method, counts in outcomes.items():
                errors = ", ".join(f"{code}: {n}" for code, n in counts.most_common() if code != "ok")
                print(f"| {method} | {sum(counts.values())} | {counts['ok']} | {errors} |")
            print(f"raw frames: {dict(raw_outcomes)}")
            print(f"untyped errors: {len(untyped)}")
            for line in untyped[:20]:
                print(f"  {line}")
            print(f"pages free: {before_pages} before, {after.pages_free if after else 'no record'} after "
                  f"(no leak: {after is not None and after.pages_free == before_pages}); server alive: "
                  f"{server.popen.poll() is None}; RSS {before_rss / 1024:.0f} MiB -> {after_rss / 1024:.0f} MiB")
        finally:
            client.shutdown()
    return 0


async def _send_raw(client: SwarmClient, record: Any, frame: bytes) -> str:
    """Sends `frame` as is on a fresh stream; gives what came back: a typed error's code, a reply, or the close."""
    from hivemind.p2p import PeerID

    from swarm.wire import read_frame

    try:
        _, reader, writer = await client.p2p.call_binary_stream_handler(PeerID.from_base58(record.peer_id), PROTOCOL)
    except Exception as error:  # the transport refused: counted, not raised
        return f"no stream ({type(error).__name__})"
    try:
        try:
            writer.write(frame)
            await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()
        except (ConnectionError, OSError) as error:  # the server refused the header and ended the stream
            return f"closed while sending ({type(error).__name__})"
        try:
            reply = await asyncio.wait_for(read_frame(reader, 1 << 20), RAW_REPLY_S)
        except TimeoutError:  # a frame that announced more bytes than came: the server waits for them
            return "no reply (waits for the rest)"
        except Exception as error:  # the server ended the stream without a reply
            return f"closed ({type(error).__name__})"
        error_map = reply.get("error")
        return error_map.get("code", "?") if isinstance(error_map, dict) else "reply"
    finally:
        writer.close()


if __name__ == "__main__":
    sys.exit(main())
