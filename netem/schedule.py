"""When the fabric delivers a packet: per-pair delay, per-host token buckets, loss, and per-pair order.

Pure (no I/O, no clock): the fabric hands each packet in with its arrival time in ns (`send`) and takes packets
out once they are due (`pop_due`, `next_ns`). Kept apart from the forwarding loop so it is unit-tested without a
TUN device.

A packet from host i to host j of `size` bytes arriving at `t`:
1. leaves i's uplink after i's token bucket (rate `bandwidth_mbit[i]`, depth `burst_bytes`) lets it through;
2. travels for half the pair's RTT;
3. enters j's downlink, which has its own token bucket;
4. is delivered, never before an earlier packet of the same pair (packets of a flow stay in order, also when
   the delays change at run time).
A packet that would wait longer than `queue_ms` in a bucket is dropped (drop-tail), as a full router queue would.
Step 3 happens in virtual time order: a packet waits in the schedule until it reaches j's downlink and is only
then admitted to its bucket, so packets from several senders share the downlink in the order they reach it (a
far sender's packet does not hold back a near sender's that arrives earlier). Packets to a host without a downlink
limit skip that stage.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

NS_PER_MS = 1_000_000
DEFAULT_QUEUE_MS = 200.0
MIN_BURST_BYTES = 3028  # two full-size Ethernet frames

Payload = TypeVar("Payload")


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
        """Gives when a packet of `size` bytes arriving at `at_ns` leaves the bucket, or None if the queue is full.

        Packets must be admitted in the order of their `at_ns`: the bucket is a FIFO queue."""
        cost_ns = size * self.ns_per_byte
        depart = max(at_ns, self.full_at_ns - self.burst_ns + cost_ns)
        if depart - at_ns > self.queue_limit_ns:
            return None
        self.full_at_ns = max(self.full_at_ns, depart) + cost_ns
        return depart


class Link:
    """The state of one ordered pair (source host, destination host)."""

    __slots__ = ("delay_ns", "destination", "in_transit", "last_ns", "loss", "reach_ns", "source")

    def __init__(self, source: int, destination: int, delay_ns: int, loss: float) -> None:
        self.source, self.destination = source, destination
        self.delay_ns, self.loss = delay_ns, loss
        self.last_ns = 0  # latest delivery time given to a packet of this pair
        self.reach_ns = 0  # latest time a packet of this pair reaches the destination's downlink
        self.in_transit = 0  # packets of this pair not yet admitted to the destination's downlink


class Schedule(Generic[Payload]):
    """The packets in flight between the hosts of one topology, each held until its delivery time."""

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
        # (time ns, sequence, link, size, payload): with a link, when the packet reaches the link's downlink;
        # without, when it is delivered. The sequence keeps packets of equal times in the order they came.
        self._heap: list[tuple[int, int, Link | None, int, Payload]] = []
        self._sequence = itertools.count()
        self.update(rtt_ms, bandwidth_mbit, loss_pct)

    def update(
        self,
        rtt_ms: Sequence[Sequence[float]],
        bandwidth_mbit: Sequence[float | None],
        loss_pct: Sequence[Sequence[float]] | None = None,
    ) -> None:
        """Changes delays, rates and loss at run time; packets on their way keep their path delay, and meet the
        new downlink rate when they reach it."""
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

    def __len__(self) -> int:
        """Gives how many packets the schedule holds."""
        return len(self._heap)

    def send(self, link: Link, size: int, arrival_ns: int, payload: Payload) -> bool:
        """Gives whether a packet of `size` bytes that arrived at `arrival_ns` on `link` is carried (False: dropped
        by loss or a full uplink queue). Arrival times must not go back: the fabric passes its clock."""
        if link.loss and self.random() < link.loss:
            self.dropped_loss += 1
            return False
        departed = self._through(self.uplinks[link.source], size, arrival_ns)
        if departed is None:
            return False
        at = departed + link.delay_ns
        if self.downlinks[link.destination] is None and not link.in_transit:
            self._push_delivery(link, at, payload)
        else:  # wait until it reaches the downlink, so that the bucket sees packets in the order they get there
            reach = max(int(at), link.reach_ns)
            link.reach_ns = reach
            link.in_transit += 1
            heapq.heappush(self._heap, (reach, next(self._sequence), link, size, payload))
        return True

    def next_ns(self) -> int | None:
        """Gives when the schedule next has something to do (a packet to admit or deliver), or None if empty."""
        return self._heap[0][0] if self._heap else None

    def pop_due(self, now_ns: float) -> tuple[int, Payload] | None:
        """Gives the next packet due at `now_ns` with its delivery time (ns), or None if none is due yet."""
        heap = self._heap
        while heap and heap[0][0] <= now_ns:
            at_ns, _, link, size, payload = heapq.heappop(heap)
            if link is None:
                return at_ns, payload
            link.in_transit -= 1
            received = self._through(self.downlinks[link.destination], size, at_ns)
            if received is not None:
                self._push_delivery(link, received, payload)
        return None

    def _through(self, bucket: TokenBucket | None, size: int, at: float) -> float | None:
        """Gives when a packet arriving at `at` leaves `bucket` (at once without one), or None if it is dropped."""
        if bucket is None:
            return at
        departed = bucket.admit(size, at)
        if departed is None:
            self.dropped_queue += 1
        return departed

    def _push_delivery(self, link: Link, at: float, payload: Payload) -> None:
        deliver = max(int(at), link.last_ns)
        link.last_ns = deliver
        heapq.heappush(self._heap, (deliver, next(self._sequence), None, 0, payload))
