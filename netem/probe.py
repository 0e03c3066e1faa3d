"""Measured RTTs (UDP or TCP echo) and bulk TCP throughput between the hosts of a running network.

All in this one process and thread: each socket is opened inside its host's namespace (`netns.entered`) and keeps
living there, so one selector loop drives echo servers and probers of every pair at once. Timestamps are taken
next to the send and receive calls, and while a probe is out the loop polls without sleeping (as busy-polling
latency tools do): a sleeping loop would add its own wake-ups, 0.2-0.5 ms each on a small VM, to every RTT.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import selectors
import socket
import statistics
import struct
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from netem import netns
from netem.network import EmulatedNetwork

PROBE = struct.Struct("!IIq")  # pair index, probe number, send time (ns)
WARMUP_PROBES = 1  # the first probe of a pair also resolves ARP on its links: not counted
TOLERANCE_REL, TOLERANCE_ABS_MS = 0.10, 1.0  # the accuracy target: within 10% + 1 ms


def within_tolerance(measured_ms: float, target_ms: float) -> bool:
    return abs(measured_ms - target_ms) <= TOLERANCE_REL * target_ms + TOLERANCE_ABS_MS


@dataclass
class RttMeasurement:
    """Measured RTTs of every pair next to the target; `measured_ms` holds each pair's median (NaN if none)."""

    hosts: tuple[str, ...]
    target_ms: list[list[float]]
    measured_ms: list[list[float]]
    proto: str
    samples_ms: dict[tuple[int, int], list[float]] = field(default_factory=dict)
    lost: int = 0

    def pairs(self) -> Iterator[tuple[int, int]]:
        return ((i, j) for i, j in itertools.combinations(range(len(self.hosts)), 2) if (i, j) in self.samples_ms)

    def failures(self) -> list[str]:
        """Gives a line per pair whose median RTT misses its target by more than 10% + 1 ms."""
        return [
            f"{self.hosts[i]}-{self.hosts[j]}: measured {self.measured_ms[i][j]:.2f} ms, target "
            f"{self.target_ms[i][j]:.2f} ms"
            for i, j in self.pairs()
            if not within_tolerance(self.measured_ms[i][j], self.target_ms[i][j])
        ]

    def excess_ms(self) -> list[float]:
        """Gives every sample's RTT minus its pair's target (what the emulation adds, incl. this loop)."""
        return [sample - self.target_ms[i][j] for (i, j), samples in self.samples_ms.items() for sample in samples]

    def to_json(self) -> dict[str, Any]:
        """Gives the measurement as JSON-ready data; a pair without samples is measured `None` (JSON has no NaN)."""
        measured = [[None if math.isnan(value) else value for value in row] for row in self.measured_ms]
        return {"hosts": list(self.hosts), "target_ms": self.target_ms, "measured_ms": measured,
                "proto": self.proto, "lost": self.lost}

    def table(self) -> str:
        """Gives a text table: one row per pair, target, measured median, error."""
        lines = [f"{'pair':<24} {'target ms':>10} {'measured ms':>12} {'error':>8}  ok"]
        for i, j in self.pairs():
            target, measured = self.target_ms[i][j], self.measured_ms[i][j]
            error = f"{100 * (measured - target) / target:+.1f}%" if target else f"{measured - target:+.2f}ms"
            ok = "yes" if within_tolerance(measured, target) else "NO"
            pair = f"{self.hosts[i]}-{self.hosts[j]}"
            lines.append(f"{pair:<24} {target:>10.2f} {measured:>12.2f} {error:>8}  {ok}")
        return "\n".join(lines)


def _socket_in(network: EmulatedNetwork, host: str, kind: int) -> socket.socket:
    with netns.entered(network.namespace(host)):
        sock = socket.socket(socket.AF_INET, kind)
    sock.setblocking(False)
    return sock


@contextlib.contextmanager
def _closing_all(socks: list[socket.socket]) -> Iterator[list[socket.socket]]:
    try:
        yield socks
    finally:
        for sock in socks:
            sock.close()


def _all_pairs(size: int) -> list[tuple[int, int]]:
    return list(itertools.combinations(range(size), 2))


def _normalized_pairs(pairs: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Gives `pairs` as (smaller, larger) host indices, each once, in their first order."""
    normalized: dict[tuple[int, int], None] = {}
    for i, j in pairs:
        if i == j:
            raise ValueError(f"a pair needs two hosts, got ({i}, {j})")
        normalized[min(i, j), max(i, j)] = None
    return list(normalized)


class _Prober:
    """One pair's probe sequence: a probe is in flight until its echo returns or it times out."""

    def __init__(self, pair: int, count: int, timeout_ns: int) -> None:
        self.pair, self.count, self.timeout_ns = pair, count, timeout_ns
        self.sent = 0
        self.sent_at = 0
        self.samples_ms: list[float] = []
        self.lost = 0
        self.waiting = False

    @property
    def done(self) -> bool:
        return self.sent >= self.count + WARMUP_PROBES and not self.waiting

    def next_probe(self) -> bytes | None:
        if self.sent >= self.count + WARMUP_PROBES:
            return None
        self.sent += 1
        self.sent_at = time.monotonic_ns()
        self.waiting = True
        return PROBE.pack(self.pair, self.sent, self.sent_at)

    def answered(self, payload: bytes, now_ns: int) -> None:
        _, number, sent_at = PROBE.unpack(payload)
        if not self.waiting or number != self.sent:
            return  # a late echo of a probe already counted as lost
        self.waiting = False
        if number > WARMUP_PROBES:
            self.samples_ms.append((now_ns - sent_at) / 1e6)

    def check_timeout(self, now_ns: int) -> None:
        if self.waiting and now_ns - self.sent_at > self.timeout_ns:
            self.waiting = False
            self.lost += 1


def measure_rtts(
    network: EmulatedNetwork, *, proto: str = "udp", count: int = 20, pairs: Iterable[tuple[int, int]] | None = None,
    timeout_s: float = 60.0,
) -> RttMeasurement:
    """Gives each pair's RTT measured by `count` echoes (after a warm-up), all pairs probed concurrently.

    A pair is measured once whichever way it is given: (j, i) is (i, j)."""
    if proto not in ("udp", "tcp"):
        raise ValueError(f"proto must be udp or tcp, got {proto!r}")
    topology = network.topology
    pair_list = _normalized_pairs(pairs) if pairs is not None else _all_pairs(topology.size)
    timeout_ns = int((1.0 + 3 * max(topology.rtt_ms[i][j] for i, j in pair_list) / 1000) * 1e9) if pair_list else 0
    probers = [_Prober(index, count, timeout_ns) for index in range(len(pair_list))]
    run = _run_udp if proto == "udp" else _run_tcp
    run(network, pair_list, probers, time.monotonic() + timeout_s)
    size = topology.size
    measured = [[0.0] * size for _ in range(size)]
    samples: dict[tuple[int, int], list[float]] = {}
    for (i, j), prober in zip(pair_list, probers, strict=True):
        median = statistics.median(prober.samples_ms) if prober.samples_ms else math.nan
        measured[i][j] = measured[j][i] = median
        samples[i, j] = prober.samples_ms
    return RttMeasurement(topology.hosts, [list(row) for row in topology.rtt_ms], measured, proto, samples,
                          sum(p.lost for p in probers))


def _poll_timeout_s(probers: list[_Prober]) -> float:
    """Gives how long the loop may block: not at all while a probe is out (its echo is timed on arrival)."""
    return 0.0 if any(prober.waiting for prober in probers) else 0.05


def _run_udp(network: EmulatedNetwork, pair_list: list[tuple[int, int]], probers: list[_Prober],
             deadline: float) -> None:
    hosts = network.hosts
    echoes = {index: _socket_in(network, hosts[index], socket.SOCK_DGRAM) for index in {j for _, j in pair_list}}
    clients = [_socket_in(network, hosts[i], socket.SOCK_DGRAM) for i, _ in pair_list]
    with _closing_all([*echoes.values(), *clients]), selectors.DefaultSelector() as selector:
        for index, echo in echoes.items():
            echo.bind((network.address(hosts[index]), 0))
            selector.register(echo, selectors.EVENT_READ, ("echo", None))
        for (i, j), client, prober in zip(pair_list, clients, probers, strict=True):
            client.bind((network.address(hosts[i]), 0))
            client.connect(echoes[j].getsockname())
            selector.register(client, selectors.EVENT_READ, ("client", prober))
        while not all(prober.done for prober in probers) and time.monotonic() < deadline:
            for client, prober in zip(clients, probers, strict=True):
                if not prober.waiting and (payload := prober.next_probe()) is not None:
                    client.send(payload)
            for key, _ in selector.select(_poll_timeout_s(probers)):
                role, prober = key.data
                sock: socket.socket = key.fileobj  # type: ignore[assignment]
                with contextlib.suppress(BlockingIOError, ConnectionRefusedError):
                    if role == "echo":
                        data, source = sock.recvfrom(64)
                        sock.sendto(data, source)
                    else:
                        prober.answered(sock.recv(64), time.monotonic_ns())
            now = time.monotonic_ns()
            for prober in probers:
                prober.check_timeout(now)


def _run_tcp(network: EmulatedNetwork, pair_list: list[tuple[int, int]], probers: list[_Prober],
             deadline: float) -> None:
    hosts = network.hosts
    listeners = {index: _socket_in(network, hosts[index], socket.SOCK_STREAM) for index in {j for _, j in pair_list}}
    clients = [_socket_in(network, hosts[i], socket.SOCK_STREAM) for i, _ in pair_list]
    accepted: list[socket.socket] = []
    with _closing_all([*listeners.values(), *clients, *accepted]) as owned, \
            selectors.DefaultSelector() as selector:
        for index, listener in listeners.items():
            listener.bind((network.address(hosts[index]), 0))
            listener.listen(len(pair_list) + 1)
            selector.register(listener, selectors.EVENT_READ, ("listen", None))
        connected = [False] * len(clients)
        buffers = [bytearray() for _ in clients]
        for index, ((i, j), client) in enumerate(zip(pair_list, clients, strict=True)):
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            client.bind((network.address(hosts[i]), 0))
            with contextlib.suppress(BlockingIOError):
                client.connect(listeners[j].getsockname())
            selector.register(client, selectors.EVENT_READ | selectors.EVENT_WRITE, ("client", index))
        while not all(prober.done for prober in probers) and time.monotonic() < deadline:
            for index, (client, prober) in enumerate(zip(clients, probers, strict=True)):
                if connected[index] and not prober.waiting and (payload := prober.next_probe()) is not None:
                    client.send(payload)
            for key, events in selector.select(_poll_timeout_s(probers)):
                role, index = key.data
                sock: socket.socket = key.fileobj  # type: ignore[assignment]
                if role == "listen":
                    conn, _ = sock.accept()
                    conn.setblocking(False)
                    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    owned.append(conn)
                    selector.register(conn, selectors.EVENT_READ, ("echo", None))
                elif role == "echo":
                    with contextlib.suppress(BlockingIOError):
                        data = sock.recv(4096)
                        if data:
                            sock.sendall(data)
                        else:
                            selector.unregister(sock)
                elif events & selectors.EVENT_WRITE and not connected[index]:
                    connected[index] = True  # the handshake finished: probe from now on
                    selector.modify(sock, selectors.EVENT_READ, key.data)
                elif events & selectors.EVENT_READ:
                    with contextlib.suppress(BlockingIOError):
                        buffers[index] += sock.recv(4096)
                    now = time.monotonic_ns()
                    while len(buffers[index]) >= PROBE.size:
                        probers[index].answered(bytes(buffers[index][: PROBE.size]), now)
                        del buffers[index][: PROBE.size]
            now = time.monotonic_ns()
            for index, prober in enumerate(probers):
                if connected[index]:
                    prober.check_timeout(now)


def measure_throughput_mbit(
    network: EmulatedNetwork, source: str, destination: str, *, seconds: float = 3.0, timeout_s: float = 60.0
) -> float:
    """Gives the goodput of one bulk TCP transfer from `source` to `destination` in Mbit/s (first to last byte
    at the receiver; the sender sends for `seconds`)."""
    chunk = bytes(1 << 16)
    listener = _socket_in(network, destination, socket.SOCK_STREAM)
    sender = _socket_in(network, source, socket.SOCK_STREAM)
    received = 0
    first_ns = last_ns = 0
    with _closing_all([listener, sender]) as owned, selectors.DefaultSelector() as selector:
        listener.bind((network.address(destination), 0))
        listener.listen(1)
        sender.bind((network.address(source), 0))
        with contextlib.suppress(BlockingIOError):
            sender.connect(listener.getsockname())
        selector.register(listener, selectors.EVENT_READ, "listen")
        selector.register(sender, selectors.EVENT_WRITE, "send")
        send_until = math.inf
        deadline = time.monotonic() + timeout_s
        finished = False
        while not finished and time.monotonic() < deadline:
            for key, _ in selector.select(0.2):
                sock: socket.socket = key.fileobj  # type: ignore[assignment]
                if key.data == "listen":
                    conn, _ = sock.accept()
                    conn.setblocking(False)
                    owned.append(conn)
                    selector.register(conn, selectors.EVENT_READ, "receive")
                elif key.data == "send":
                    if send_until == math.inf:
                        send_until = time.monotonic() + seconds
                    if time.monotonic() >= send_until:
                        sock.shutdown(socket.SHUT_WR)
                        selector.unregister(sock)
                        continue
                    with contextlib.suppress(BlockingIOError):
                        sock.send(chunk)
                else:
                    try:
                        data = sock.recv(1 << 20)
                    except BlockingIOError:
                        continue
                    if not data:
                        finished = True
                        break
                    last_ns = time.monotonic_ns()
                    if first_ns:
                        received += len(data)
                    else:  # the clock starts at the first byte: what came with it is not counted
                        first_ns = last_ns
    if not finished or last_ns <= first_ns:
        raise TimeoutError(f"bulk transfer {source}->{destination} did not finish within {timeout_s} s")
    return received * 8 / ((last_ns - first_ns) / 1e9) / 1e6
