"""When the fabric delivers a packet: per-pair delay, per-host token buckets, loss, and per-pair order.

Pure (no I/O, no clock): the fabric passes each packet's arrival time in ns and gets its delivery time, or None
when the packet is dropped. Kept apart from the forwarding loop so it is unit-tested without a TUN device.

A packet from host i to host j of `size` bytes arriving at `t`:
1. leaves i's uplink after i's token bucket (rate `bandwidth_mbit[i]`, depth `burst_bytes`) lets it through;
2. travels for half the pair's RTT;
3. enters j's downlink, which has its own token bucket;
4. is delivered, never before an earlier packet of the same pair (packets of a flow stay in order, also when
   the delays change at run time).
A packet that would wait longer than `queue_ms` in a bucket is dropped (drop-tail), as a full router queue would.
The downlink bucket serves packets in fabric-arrival order, a small simplification when several senders share it.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

NS_PER_MS = 1_000_000
DEFAULT_QUEUE_MS = 200.0
MIN_BURST_BYTES = 3028  # two full-size Ethernet frames


@dataclass
class TokenBucket:
    """A token bucket of `burst_ns` worth of bytes, in its GCRA form: `full_at_ns` is when the bucket would be full
    again if no more packets came (a packet may leave once the bucket holds its size in tokens)."""

    ns_per_byte: float
    burst_ns: float
    queue_limit_ns: float
    full_at_ns: float = 0.0

    @classmethod
    def for_rate(cls, mbit: float, queue_ms: float) -> TokenBucket:
        ns_per_byte = 8_000.0 / mbit  # 1 Mbit/s = 125_000 bytes/s
        burst_bytes = max(MIN_BURST_BYTES, mbit * 125.0)  # about 1 ms of the rate
        return cls(ns_per_byte, burst_bytes * ns_per_byte, queue_limit_ns=queue_ms * NS_PER_MS)

    def admit(self, size: int, at_ns: float) -> float | None:
        """Gives when a packet of `size` bytes arriving at `at_ns` leaves the bucket, or None if the queue is full."""
        cost_ns = size * self.ns_per_byte
        depart = max(at_ns, self.full_at_ns - self.burst_ns + cost_ns)
        if depart - at_ns > self.queue_limit_ns:
            return None
        self.full_at_ns = max(self.full_at_ns, depart) + cost_ns
        return depart


class Link:
    """The state of one ordered pair (source host, destination host)."""

    __slots__ = ("delay_ns", "destination", "last_ns", "loss", "source")

    def __init__(self, source: int, destination: int, delay_ns: int, loss: float) -> None:
        self.source, self.destination = source, destination
        self.delay_ns, self.loss = delay_ns, loss
        self.last_ns = 0


class Schedule:
    """Delivery times for packets between the hosts of one topology."""

    def __init__(
        self,
        rtt_ms: Sequence[Sequence[float]],
        bandwidth_mbit: Sequence[float | None],
        loss_pct: Sequence[Sequence[float]] | None = None,
        *,
        queue_ms: float = DEFAULT_QUEUE_MS,
        seed: int = 0,
    ) -> None:
        self.size = len(rtt_ms)
        self.queue_ms = queue_ms
        self.random = random.Random(seed).random
        self.links = [[Link(i, j, 0, 0.0) for j in range(self.size)] for i in range(self.size)]
        self.uplinks: list[TokenBucket | None] = [None] * self.size
        self.downlinks: list[TokenBucket | None] = [None] * self.size
        self.dropped_loss = self.dropped_queue = 0
        self.update(rtt_ms, bandwidth_mbit, loss_pct)

    def update(
        self,
        rtt_ms: Sequence[Sequence[float]],
        bandwidth_mbit: Sequence[float | None],
        loss_pct: Sequence[Sequence[float]] | None = None,
    ) -> None:
        """Changes delays, rates and loss at run time; packets already scheduled keep their times."""
        if len(rtt_ms) != self.size or len(bandwidth_mbit) != self.size:
            raise ValueError(f"the schedule has {self.size} hosts")
        for i, row in enumerate(self.links):
            for j, link in enumerate(row):
                link.delay_ns = round(rtt_ms[i][j] * NS_PER_MS / 2)  # one way: half the round trip
                link.loss = loss_pct[i][j] / 100 if loss_pct is not None else 0.0
        for i, mbit in enumerate(bandwidth_mbit):
            if mbit is None:
                self.uplinks[i] = self.downlinks[i] = None
            elif self.uplinks[i] is None or self.uplinks[i].ns_per_byte != 8_000.0 / mbit:  # type: ignore[union-attr]
                self.uplinks[i] = TokenBucket.for_rate(mbit, self.queue_ms)
                self.downlinks[i] = TokenBucket.for_rate(mbit, self.queue_ms)

    def deliver_at(self, link: Link, size: int, arrival_ns: int) -> int | None:
        """Gives when to deliver a packet of `size` bytes that arrived at `arrival_ns` on `link`, or None to drop it."""
        if link.loss and self.random() < link.loss:
            self.dropped_loss += 1
            return None
        at: float = arrival_ns
        uplink = self.uplinks[link.source]
        if uplink is not None:
            departed = uplink.admit(size, at)
            if departed is None:
                self.dropped_queue += 1
                return None
            at = departed
        at += link.delay_ns
        downlink = self.downlinks[link.destination]
        if downlink is not None:
            received = downlink.admit(size, at)
            if received is None:
                self.dropped_queue += 1
                return None
            at = received
        deliver = int(at)
        if deliver < link.last_ns:
            deliver = link.last_ns
        link.last_ns = deliver
        return deliver
