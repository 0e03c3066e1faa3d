"""The `tc` backend: kernel netem qdiscs with a delay per destination, for kernels that have `sch_netem`.

On each host's `eth0` (its egress) an htb tree classifies packets by destination address:

    root htb 1: (default 1:2)
      class 1:1   rate = the host's uplink (bandwidth_mbit, else 10gbit)
        class 1:2             unclassified traffic (ARP to the router): not delayed
        class 1:<16+j> (hex)  traffic to host j -> netem qdisc: delay RTT(i, j) / 2, loss
      u32 filters: ip dst <address of j>/32 -> class 1:<16+j>

Both directions of a pair are delayed by half its RTT, so a round trip takes the RTT. A host's downlink limit is a
tbf on the router's side of its veth. The builders are pure (argv lists) and unit-tested; `TcBackend` runs them.
"""

from __future__ import annotations

from netem import netns
from netem.layout import HOST_DEVICE, Layout
from netem.schedule import DEFAULT_QUEUE_MS
from netem.topology import Topology

UNLIMITED_RATE = "10gbit"
NETEM_LIMIT_PACKETS = "100000"  # netem's default of 1000 packets overflows at high rate * delay
FIRST_DEST_MINOR = 16


def _rate(mbit: float | None) -> str:
    return f"{mbit:g}mbit" if mbit else UNLIMITED_RATE


def _minor(destination: int) -> str:
    return f"{FIRST_DEST_MINOR + destination:x}"  # tc class and handle numbers are hexadecimal


def netem_args(topology: Topology, source: int, destination: int) -> list[str]:
    """Gives the netem parameters for packets from host `source` to host `destination`."""
    delay_us = round(topology.rtt_ms[source][destination] * 1000 / 2)
    args = ["netem", "delay", f"{delay_us}us"]
    if topology.loss_pct is not None and topology.loss_pct[source][destination] > 0:
        args += ["loss", f"{topology.loss_pct[source][destination]:g}%"]
    return [*args, "limit", NETEM_LIMIT_PACKETS]


def host_commands(layout: Layout, topology: Topology, source: int) -> list[list[str]]:
    """Gives the `tc` invocations that delay what host `source` sends, per destination."""
    namespace = layout.namespace(topology.hosts[source])
    rate = _rate(topology.bandwidth_mbit.get(topology.hosts[source]))
    tc = ["tc", "-n", namespace]
    dev = ["dev", HOST_DEVICE]
    commands = [
        [*tc, "qdisc", "add", *dev, "root", "handle", "1:", "htb", "default", "2"],
        [*tc, "class", "add", *dev, "parent", "1:", "classid", "1:1", "htb", "rate", rate, "ceil", rate],
        [*tc, "class", "add", *dev, "parent", "1:1", "classid", "1:2", "htb", "rate", rate, "ceil", rate],
    ]
    for destination in range(topology.size):
        if destination == source:
            continue
        minor = _minor(destination)
        commands += [
            [*tc, "class", "add", *dev, "parent", "1:1", "classid", f"1:{minor}", "htb", "rate", rate, "ceil", rate],
            [*tc, "qdisc", "add", *dev, "parent", f"1:{minor}", "handle", f"{minor}:",
             *netem_args(topology, source, destination)],
            [*tc, "filter", "add", *dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
             "match", "ip", "dst", f"{netns.host_address(destination)}/32", "flowid", f"1:{minor}"],
        ]
    return commands


def downlink_commands(layout: Layout, topology: Topology, host: int, verb: str = "add") -> list[list[str]]:
    """Gives the tbf that limits what host `host` receives (none without a bandwidth for it)."""
    mbit = topology.bandwidth_mbit.get(topology.hosts[host])
    if mbit is None:
        return []
    burst_bytes = max(15_140, round(mbit * 125))  # at least 10 full frames, about 1 ms of the rate
    return [["tc", "-n", layout.hub, "qdisc", verb, "dev", layout.hub_device(host), "root", "tbf",
             "rate", _rate(mbit), "burst", str(burst_bytes), "latency", f"{DEFAULT_QUEUE_MS:g}ms"]]


def downlink_removals(layout: Layout, topology: Topology) -> list[list[str]]:
    """Gives the deletes of the tbf of every host without a bandwidth in `topology` (a limit an earlier topology may
    have set); each fails harmlessly where there is none, so run them without checking."""
    return [["tc", "-n", layout.hub, "qdisc", "del", "dev", layout.hub_device(host), "root"]
            for host, name in enumerate(topology.hosts) if name not in topology.bandwidth_mbit]


def update_commands(layout: Layout, topology: Topology) -> list[list[str]]:
    """Gives the `tc` invocations that change delays, loss and rates of a running tree to `topology`'s (limits
    it no longer has are removed by `downlink_removals`)."""
    commands = []
    for source, host in enumerate(topology.hosts):
        tc = ["tc", "-n", layout.namespace(host)]
        rate = _rate(topology.bandwidth_mbit.get(host))
        for classid in ("1:1", "1:2"):
            parent = "1:" if classid == "1:1" else "1:1"
            commands.append([*tc, "class", "change", "dev", HOST_DEVICE, "parent", parent, "classid", classid,
                             "htb", "rate", rate, "ceil", rate])
        for destination in range(topology.size):
            if destination != source:
                minor = _minor(destination)
                commands += [
                    [*tc, "class", "change", "dev", HOST_DEVICE, "parent", "1:1", "classid", f"1:{minor}", "htb",
                     "rate", rate, "ceil", rate],
                    [*tc, "qdisc", "change", "dev", HOST_DEVICE, "parent", f"1:{minor}", "handle", f"{minor}:",
                     *netem_args(topology, source, destination)],
                ]
        commands += downlink_commands(layout, topology, source, verb="replace")
    return commands


def netem_available(namespace: str) -> bool:
    """Gives whether this kernel has `sch_netem`, probed on the loopback of one of the run's namespaces."""
    probe = ["tc", "-n", namespace, "qdisc", "add", "dev", "lo", "root", "netem", "delay", "1ms"]
    try:
        netns.run(probe)
    except netns.NetnsError:
        return False
    netns.run(["tc", "-n", namespace, "qdisc", "del", "dev", "lo", "root"], check=False)
    return True


class TcBackend:
    """Delays with kernel netem qdiscs; nothing to stop (the qdiscs go with the namespaces)."""

    name = "tc"

    def __init__(self, layout: Layout, **_options: object) -> None:
        self.layout = layout

    def start(self, topology: Topology) -> None:
        for source in range(topology.size):
            for argv in [*host_commands(self.layout, topology, source), *downlink_commands(self.layout, topology,
                                                                                          source)]:
                netns.run(argv)

    def update(self, topology: Topology) -> None:
        for argv in downlink_removals(self.layout, topology):
            netns.run(argv, check=False)  # there may be no limit to remove
        for argv in update_commands(self.layout, topology):
            netns.run(argv)

    def stats(self) -> dict[str, object]:
        return {}

    def reset_stats(self) -> None:
        pass

    def stop(self) -> None:
        pass
