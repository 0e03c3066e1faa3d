"""How long a message takes to cross one emulated WAN link between two swarm peers, beyond the round trip of a small
one, next to the link's rate: whether a prompt's hidden states, as the client relays them through a pipeline, cross
at the rate the KunServe simulator gives them (`KunServeSimConfig.client_link_bytes_per_s`).

    sudo .venv/bin/python benchmarks/link_crossing.py [--rtt 20 40] [--tokens 16 64 128 256]

A prompt of 256 tokens is 590 KB of float32 hidden states: 47 ms at 100 Mbit/s. A message need not leave at the
link's rate: TCP sends a window a round trip and grows it, Linux starts it over after a connection idled, and the
stream multiplexer has windows of its own, so over tens of milliseconds of round trip a crossing could cost round
trips as well as bytes. This measures it.

The rig: two hosts of an emulated network (`netem`), every pair at `--rtt` ms and 100 Mbit/s, as the burst
benchmark's; one serves an RPC method that answers a message with its length, or with as many bytes as asked
(`swarm.rpc` over hivemind's p2pd, the transport every swarm call takes); the other calls it, `ROUNDS` times per size:
on one warmed stream, a message after `IDLE_S` without traffic and again at once, a reply of the size after `IDLE_S`,
and 64 bytes; then, as a session's prompt crosses, a message and a reply of the size each as the first after a small
call on a new stream (a client opens a stream per session and server, and the multiplexer starts each new stream's
window small: from 128 tokens on, these took 0.4-1.5 round trips beyond their bytes, Dec 7). A size's
crossing is its median call less the median small call. Needs root (network namespaces). Never asserts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hivemind.p2p import P2P

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from netem.network import EmulatedNetwork
from netem.topology import constant
from swarm.rpc import RpcConnection, RpcServer

HOSTS = ("client", "a")
MBIT = 100.0
BYTES_PER_TOKEN = 576 * 4  # SmolLM2's hidden size, float32 on the wire
TOKENS = (16, 64, 128, 256)
SMALL_BYTES = 64
ROUNDS = 7
IDLE_S = 1.0  # longer than Linux's idle threshold (the retransmission timeout, at least 200 ms)
PORT = 41999


@dataclass(frozen=True)
class LinkCrossing:
    """The rig's reading at one RTT: per message size (bytes), its median crossing beyond the small call (s): sent
    after an idle gap, sent back to back, and received (a reply of the size) after an idle gap, on one warmed stream;
    sent and received as the first of its size on a new stream (empty in readings kept before Dec 7)."""

    rtt_ms: float
    sizes: tuple[int, ...]
    idle_s: tuple[float, ...]
    busy_s: tuple[float, ...]
    down_s: tuple[float, ...]
    small_call_s: float
    fresh_up_s: tuple[float, ...] = ()
    fresh_down_s: tuple[float, ...] = ()

    def relayed_extra_s(self) -> tuple[tuple[int, float], ...]:
        """Gives, per size, what a prompt's message took beyond its bytes at the rig's rate (`MBIT`): the mean of one
        sent and one received on a new stream, as each session's prompt goes up to a server and comes back from it
        on the stream the session opened there; in readings without those, the mean of one sent right after another
        and one coming back as a reply on a warmed stream."""
        up, down = (self.fresh_up_s, self.fresh_down_s) if self.fresh_up_s else (self.busy_s, self.down_s)
        return tuple((size, max(0.0, (sent + received) / 2 - size * 8 / (MBIT * 1e6)))
                     for size, sent, received in zip(self.sizes, up, down, strict=True))


def measure(rtt_ms: float, tokens: Sequence[int] = TOKENS) -> LinkCrossing:
    """Runs the rig at `rtt_ms` and gives its reading."""
    script = str(Path(__file__).resolve())
    with EmulatedNetwork(constant(HOSTS, rtt_ms, mbit=MBIT), run_id=f"lc{int(rtt_ms)}") as network:
        server = network.spawn("a", [sys.executable, script, "--serve", network.address("a")], name="link-serve")
        maddr = server.wait_for_line("ready ", 120).split()[1]
        probe = network.spawn("client", [sys.executable, script, "--probe", maddr, "--tokens", *map(str, tokens)],
                              name="link-probe")
        line = probe.wait_for_line("{", 300 + ROUNDS * len(tokens) * 3 * IDLE_S)
        probe.stop()
        server.stop()
    reading = json.loads(line)
    return LinkCrossing(rtt_ms, tuple(reading["sizes"]), tuple(reading["idle_s"]), tuple(reading["busy_s"]),
                        tuple(reading["down_s"]), reading["small_call_s"], tuple(reading["fresh_up_s"]),
                        tuple(reading["fresh_down_s"]))


async def _serve(address: str) -> None:
    p2p = await P2P.create(host_maddrs=[f"/ip4/{address}/tcp/{PORT}"])
    server = RpcServer(p2p)

    async def length(payload: dict[str, Any], _ctx: Any) -> dict[str, Any]:
        return {"bytes": len(payload["blob"]), "blob": bytes(payload.get("reply", 0))}

    server.add_method("length", length)
    await server.start()
    print(f"ready /ip4/{address}/tcp/{PORT}/p2p/{p2p.peer_id}", flush=True)
    await asyncio.Event().wait()


async def _probe(maddr: str, tokens: Sequence[int]) -> None:
    p2p = await P2P.create(initial_peers=[maddr])
    connection = await RpcConnection.open(p2p, maddr.rsplit("/", 1)[1], timeout=30)
    sizes = [count * BYTES_PER_TOKEN for count in tokens]

    async def call(nbytes: int, reply: int = 0, on: RpcConnection = connection) -> float:
        started = time.perf_counter()
        await on.call("length", {"blob": bytes(nbytes), "reply": reply}, timeout=60)
        return time.perf_counter() - started

    async def first(nbytes: int, reply: int = 0) -> float:
        """Times a message of the size, or its reply, first after a small call on a new stream: a session's prompt."""
        stream = await RpcConnection.open(p2p, maddr.rsplit("/", 1)[1], timeout=30)
        try:
            await call(SMALL_BYTES, on=stream)
            return await call(nbytes, reply, on=stream)
        finally:
            await stream.close()

    for nbytes in (SMALL_BYTES, *sizes):  # warm: the connection and both ends' code, both ways
        await call(nbytes, nbytes)
    small, idle, busy, down = [], {n: [] for n in sizes}, {n: [] for n in sizes}, {n: [] for n in sizes}
    fresh_up, fresh_down = {n: [] for n in sizes}, {n: [] for n in sizes}
    for _ in range(ROUNDS):
        for nbytes in sizes:
            await asyncio.sleep(IDLE_S)
            small.append(await call(SMALL_BYTES))
            await asyncio.sleep(IDLE_S)
            idle[nbytes].append(await call(nbytes))
            busy[nbytes].append(await call(nbytes))
            await asyncio.sleep(IDLE_S)
            down[nbytes].append(await call(SMALL_BYTES, nbytes))
            fresh_up[nbytes].append(await first(nbytes))
            fresh_down[nbytes].append(await first(SMALL_BYTES, nbytes))
    base = statistics.median(small)

    def beyond(calls: dict[int, list[float]]) -> list[float]:
        return [max(0.0, statistics.median(calls[n]) - base) for n in sizes]

    print(json.dumps({"sizes": sizes, "small_call_s": base, "idle_s": beyond(idle), "busy_s": beyond(busy),
                      "down_s": beyond(down), "fresh_up_s": beyond(fresh_up), "fresh_down_s": beyond(fresh_down)}),
          flush=True)
    await connection.close()
    await p2p.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rtt", type=float, nargs="+", default=[20.0, 40.0])
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    parser.add_argument("--serve", metavar="ADDRESS", help=argparse.SUPPRESS)
    parser.add_argument("--probe", metavar="MADDR", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        asyncio.run(_serve(args.serve))
        return 0
    if args.probe:
        asyncio.run(_probe(args.probe, args.tokens))
        return 0
    print(f"{'RTT':>5} {'tokens':>6} {'bytes':>8} {'at 100 Mbit/s':>13} {'sent after idle':>19} "
          f"{'sent back to back':>19} {'received after idle':>19} {'sent, new stream':>19} "
          f"{'received, new stream':>20}")
    for rtt_ms in args.rtt:
        reading = measure(rtt_ms, args.tokens)
        for count, nbytes, *measured in zip(args.tokens, reading.sizes, reading.idle_s, reading.busy_s,
                                            reading.down_s, reading.fresh_up_s, reading.fresh_down_s, strict=True):
            line_s = nbytes * 8 / (MBIT * 1e6)
            cells = " ".join(f"{seconds * 1000:7.0f} ms ({seconds / line_s:4.2f}x)" for seconds in measured)
            print(f"{rtt_ms:5g} {count:6d} {nbytes:8d} {line_s * 1000:10.0f} ms {cells}")
        print(f"{rtt_ms:5g} a {SMALL_BYTES}-byte call: {reading.small_call_s * 1000:.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
