"""The user-space delay fabric: one process that forwards every packet between hosts after the pair's delay.

Runs inside the run's router namespace (`python -m netem.fabric --config fabric.json`). The router sends every
packet coming from a host into one TUN device; this loop reads it and hands it to `netem.schedule`, which holds
it until its delivery time (half the pair's RTT after it was read, plus token-bucket waits); the loop writes what
is due back into the TUN device, and the router forwards it to the destination host.

One thread, one epoll loop over the TUN fd, a timerfd armed at the earliest deadline (ns precision, unlike
epoll's ms timeout), the control socket and a signal wakeup fd. Reads are drained in batches; the delay counts
from the moment a packet is read. It asks for SCHED_FIFO so that busy CPUs delay its wakeups as little as they
would delay the kernel's own netem (which runs in softirq context); without the right it runs at normal priority.
For idle CPUs it holds a CPU latency request of 0 us (`/dev/cpu_dma_latency`, what cyclictest and tuned's
latency-performance profile do) while it runs: a halted vCPU takes 0.3-1 ms to wake, which every packet's
delivery and every sleeping endpoint paid, so that measured RTTs sat up to 2 ms above the target on an idle VM.

Control: a unix socket at `control` takes one JSON line, answers one JSON line: `{"op": "stats"}`,
`{"op": "reset"}` (clears counters and lateness samples), `{"op": "update", "rtt_ms": ..., "bandwidth_mbit": [...],
"loss_pct": ...}` (new delays at run time).
"""

from __future__ import annotations

import argparse
import array
import contextlib
import ctypes
import fcntl
import json
import os
import select
import signal
import socket
import struct
import sys
import time
from dataclasses import dataclass
from typing import Any

from netem.schedule import DEFAULT_QUEUE_MS, Link, Schedule

TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000
MAX_PACKET = 65536
READ_BATCH = 256  # packets read per wakeup before delivering what is due
LATENESS_SAMPLES = 1 << 16  # ring of the latest delivery latenesses (ns)
FIFO_PRIORITY = 10
POLL_S = 1.0  # bounds a wait even if no timer or packet wakes the loop
CLOCK_MONOTONIC, TFD_NONBLOCK, TFD_CLOEXEC, TFD_TIMER_ABSTIME = 1, 0o4000, 0o2000000, 1
PR_SET_TIMERSLACK = 29

_libc = ctypes.CDLL(None, use_errno=True)


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


class DeadlineTimer:
    """A timerfd on CLOCK_MONOTONIC (the clock of time.monotonic_ns) armed at absolute ns deadlines."""

    def __init__(self) -> None:
        self.fd = _libc.timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "timerfd_create failed")
        self.armed_ns = -1

    def arm(self, deadline_ns: int) -> None:
        deadline_ns = max(deadline_ns, 1)  # 0 would disarm
        spec = _Itimerspec(_Timespec(0, 0), _Timespec(deadline_ns // 1_000_000_000, deadline_ns % 1_000_000_000))
        if _libc.timerfd_settime(self.fd, TFD_TIMER_ABSTIME, ctypes.byref(spec), None) != 0:
            raise OSError(ctypes.get_errno(), "timerfd_settime failed")
        self.armed_ns = deadline_ns

    def clear(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.read(self.fd, 8)


def open_tun(name: str) -> int:
    """Gives a non-blocking fd of a new TUN device `name` (layer 3, no packet-info header) in this namespace."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


def make_realtime() -> bool:
    """Gives whether this process now runs SCHED_FIFO; asks for 1 ns timer slack either way."""
    _libc.prctl(PR_SET_TIMERSLACK, 1, 0, 0, 0)
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(FIFO_PRIORITY))
    except (PermissionError, OSError):
        return False
    return True


def hold_low_cpu_latency() -> int | None:
    """Asks the kernel to keep CPUs out of idle states that take time to leave, for as long as this process lives
    (or the returned fd stays open); gives the fd, or None without the right."""
    try:
        fd = os.open("/dev/cpu_dma_latency", os.O_WRONLY)
    except OSError:
        return None
    os.write(fd, (0).to_bytes(4, sys.byteorder))
    return fd


@dataclass
class FabricConfig:
    """What the controller tells the fabric: host addresses in topology order and the network between them."""

    tun: str
    addresses: list[str]
    rtt_ms: list[list[float]]
    bandwidth_mbit: list[float | None]
    control: str
    loss_pct: list[list[float]] | None = None
    queue_ms: float = DEFAULT_QUEUE_MS
    realtime: bool = True
    seed: int = 0

    @classmethod
    def load(cls, path: str) -> FabricConfig:
        with open(path) as file:
            return cls(**json.load(file))


def percentile(sorted_values: list[int], fraction: float) -> float:
    if not sorted_values:
        return float("nan")
    return float(sorted_values[min(len(sorted_values) - 1, int(fraction * len(sorted_values)))])


class Fabric:
    """The forwarding loop; `run()` returns after SIGTERM or SIGINT."""

    def __init__(self, config: FabricConfig) -> None:
        self.config = config
        self.schedule: Schedule[bytes] = Schedule(config.rtt_ms, config.bandwidth_mbit, config.loss_pct,
                                                  queue_ms=config.queue_ms, seed=config.seed)
        packed = [socket.inet_aton(address) for address in config.addresses]
        # The 8 bytes at offset 12 of an IPv4 header are source + destination: one dict lookup finds the pair.
        self.links: dict[bytes, Link] = {
            packed[i] + packed[j]: self.schedule.links[i][j]
            for i in range(len(packed)) for j in range(len(packed)) if i != j
        }
        self.realtime = False
        self.reset_stats()
        self.tun = open_tun(config.tun)
        self.timer = DeadlineTimer()
        self.control = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(config.control)
        self.control.bind(config.control)
        self.control.listen(8)
        self.control.setblocking(False)
        self.clients: dict[int, tuple[socket.socket, bytearray]] = {}
        self.wakeup_read, self.wakeup_write = socket.socketpair()
        self.wakeup_read.setblocking(False)
        self.wakeup_write.setblocking(False)
        self.stopping = False

    def reset_stats(self) -> None:
        self.packets_in = self.packets_out = self.bytes_in = self.foreign = self.write_errors = 0
        self.lateness_ns = array.array("q", bytes(8 * LATENESS_SAMPLES))
        self.lateness_count = 0
        self.schedule.dropped_loss = self.schedule.dropped_queue = 0
        self.tun_dropped_at_reset = self.tun_dropped()

    def tun_dropped(self) -> int:
        """Gives how many packets the kernel dropped because the TUN queue was full (we read too slowly)."""
        try:
            with open(f"/sys/class/net/{self.config.tun}/statistics/tx_dropped") as counter:
                return int(counter.read())
        except (OSError, ValueError):  # /sys of another namespace, or the device is gone
            return 0

    def stats(self) -> dict[str, Any]:
        """Gives counters since the last reset and the delivery lateness percentiles in microseconds."""
        held = self.lateness_ns[: min(self.lateness_count, LATENESS_SAMPLES)]
        ordered = sorted(held)
        return {
            "packets_in": self.packets_in, "packets_out": self.packets_out, "bytes_in": self.bytes_in,
            "dropped_loss": self.schedule.dropped_loss, "dropped_queue": self.schedule.dropped_queue,
            "foreign": self.foreign, "write_errors": self.write_errors, "queued": len(self.schedule),
            "tun_dropped": self.tun_dropped() - self.tun_dropped_at_reset,
            "realtime": self.realtime,
            "lateness_us": {
                "samples": len(ordered),
                "p50": percentile(ordered, 0.5) / 1000,
                "p99": percentile(ordered, 0.99) / 1000,
                "max": (ordered[-1] / 1000) if ordered else float("nan"),
            },
        }

    def read_packets(self) -> None:
        read, now_ns, links, send = os.read, time.monotonic_ns, self.links, self.schedule.send
        for _ in range(READ_BATCH):
            try:
                packet = read(self.tun, MAX_PACKET)
            except BlockingIOError:
                return
            arrival = now_ns()
            self.packets_in += 1
            self.bytes_in += len(packet)
            link = links.get(packet[12:20]) if packet[0] >> 4 == 4 else None
            if link is None:  # not IPv4 between two hosts of this run (e.g. IPv6 chatter): not ours to carry
                self.foreign += 1
                continue
            send(link, len(packet), arrival, packet)

    def deliver_due(self) -> None:
        write, now_ns, pop_due = os.write, time.monotonic_ns, self.schedule.pop_due
        lateness, mask = self.lateness_ns, LATENESS_SAMPLES - 1
        now = now_ns()
        while (due := pop_due(now)) is not None:
            deliver, packet = due
            lateness[self.lateness_count & mask] = now - deliver
            self.lateness_count += 1
            try:
                write(self.tun, packet)
                self.packets_out += 1
            except OSError:  # e.g. the device went down during teardown
                self.write_errors += 1
            now = now_ns()
        next_ns = self.schedule.next_ns()
        if next_ns is not None and next_ns != self.timer.armed_ns:
            self.timer.arm(next_ns)

    def handle_control(self, fd: int, poller: select.epoll) -> None:
        if fd == self.control.fileno():
            with contextlib.suppress(BlockingIOError):
                conn, _ = self.control.accept()
                conn.setblocking(False)
                self.clients[conn.fileno()] = (conn, bytearray())
                poller.register(conn.fileno(), select.EPOLLIN)
            return
        conn, buffer = self.clients[fd]
        try:
            chunk = conn.recv(1 << 20)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        buffer += chunk
        if chunk and b"\n" not in buffer and len(buffer) < (16 << 20):
            return
        poller.unregister(fd)
        del self.clients[fd]
        with conn:
            if not chunk and b"\n" not in buffer:
                return
            try:
                reply = self.answer(json.loads(buffer.split(b"\n", 1)[0]))
            except Exception as error:  # a bad request must not stop the fabric
                reply = {"error": f"{type(error).__name__}: {error}"}
            conn.setblocking(True)
            conn.settimeout(2.0)
            with contextlib.suppress(OSError):
                conn.sendall(json.dumps(reply).encode() + b"\n")

    def answer(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request.get("op")
        if op == "stats":
            return self.stats()
        if op == "reset":
            self.reset_stats()
            return {"ok": True}
        if op == "update":
            self.schedule.update(request["rtt_ms"], request["bandwidth_mbit"], request.get("loss_pct"))
            return {"ok": True}
        raise ValueError(f"unknown op {op!r}")

    def run(self) -> None:
        poller = select.epoll()
        tun, timer, control, wakeup = self.tun, self.timer.fd, self.control.fileno(), self.wakeup_read.fileno()
        for fd in (tun, timer, control, wakeup):
            poller.register(fd, select.EPOLLIN)
        signal.set_wakeup_fd(self.wakeup_write.fileno(), warn_on_full_buffer=False)
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: setattr(self, "stopping", True))
        try:
            while not self.stopping:
                for fd, _ in poller.poll(POLL_S):
                    if fd == tun:
                        self.read_packets()
                    elif fd == timer:
                        self.timer.clear()
                    elif fd == wakeup:
                        with contextlib.suppress(BlockingIOError):
                            self.wakeup_read.recv(64)
                    else:
                        self.handle_control(fd, poller)
                self.deliver_due()
        finally:
            poller.close()
            os.close(self.tun)
            self.control.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.config.control)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="netem user-space delay fabric (started by netem, not by hand)")
    parser.add_argument("--config", required=True, help="fabric JSON config written by the controller")
    args = parser.parse_args(argv)
    config = FabricConfig.load(args.config)
    fabric = Fabric(config)
    fabric.realtime = make_realtime() if config.realtime else False
    latency_fd = hold_low_cpu_latency() if config.realtime else None
    print(f"fabric ready tun={config.tun} hosts={len(config.addresses)} realtime={fabric.realtime} "
          f"cpu_latency_held={latency_fd is not None}", flush=True)
    fabric.run()
    print(f"fabric stopped {json.dumps(fabric.stats())}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
