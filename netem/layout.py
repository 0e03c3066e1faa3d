"""The wiring of one run: a namespace per host, each joined by a veth pair to the run's router namespace.

    host h_i namespace                     router namespace (csnet-<run>-_hub)
    eth0 10.77.0.(i+1)/32  <-- veth -->  v<i> (gateway 10.77.0.254), route 10.77.0.(i+1)/32 dev v<i>
    route 10.77.0.0/24 via 10.77.0.254

The router forwards between hosts; a delay backend makes the forwarding slow (tc qdiscs on the links, or the
fabric, to which the router hands every packet through a TUN device). IPv6 is off in every namespace of the run,
so only the traffic a test starts crosses the links.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

from netem import netns

HOST_DEVICE = "eth0"


@dataclass(frozen=True)
class Layout:
    """Names and addresses of one run's namespaces and links (derived from the run id and the host list)."""

    run_id: str
    hosts: tuple[str, ...]
    state_dir: Path

    @property
    def hub(self) -> str:
        return netns.hub_namespace(self.run_id)

    def namespace(self, host: str) -> str:
        self.index(host)
        return netns.host_namespace(self.run_id, host)

    def index(self, host: str) -> int:
        try:
            return self.hosts.index(host)
        except ValueError:
            raise KeyError(f"run {self.run_id} has no host {host!r} (hosts: {', '.join(self.hosts)})") from None

    def address(self, host: str) -> str:
        return netns.host_address(self.index(host))

    @property
    def addresses(self) -> list[str]:
        return [netns.host_address(i) for i in range(len(self.hosts))]

    @staticmethod
    def hub_device(index: int) -> str:
        return f"v{index}"

    @property
    def namespaces(self) -> list[str]:
        return [self.hub, *(self.namespace(host) for host in self.hosts)]


def ip_batch(namespace: str, lines: list[str]) -> None:
    """Runs `ip` commands inside `namespace` in one process (`ip -n NS -batch -`)."""
    try:
        done = subprocess.run(
            ["ip", "-n", namespace, "-batch", "-"], input="\n".join(lines) + "\n", capture_output=True, text=True,
            timeout=netns.IP_TIMEOUT_S, check=False,
        )
    except subprocess.TimeoutExpired:
        raise netns.NetnsError(f"ip -n {namespace} -batch did not finish within {netns.IP_TIMEOUT_S} s") from None
    if done.returncode != 0:
        raise netns.NetnsError(f"ip -n {namespace} -batch failed: {done.stderr.strip()}\n" + "\n".join(lines))


QUIET_SYSCTLS = {"net.ipv6.conf.all.disable_ipv6": "1", "net.ipv6.conf.default.disable_ipv6": "1"}
ROUTER_SYSCTLS = {
    **QUIET_SYSCTLS,
    "net.ipv4.ip_forward": "1",
    # Packets come back from the fabric's TUN device with host sources that route via the veths: not spoofed.
    "net.ipv4.conf.all.rp_filter": "0",
    "net.ipv4.conf.default.rp_filter": "0",
    "net.ipv4.conf.all.send_redirects": "0",
    "net.ipv4.conf.default.send_redirects": "0",
}


def wire(layout: Layout) -> None:
    """Creates the router and host namespaces and the veth links between them (see the module doc)."""
    hub = layout.hub
    netns.add_namespace(hub)
    netns.set_sysctls(hub, ROUTER_SYSCTLS)
    hub_lines = []
    for index, host in enumerate(layout.hosts):
        namespace, address, device = layout.namespace(host), layout.address(host), layout.hub_device(index)
        netns.add_namespace(namespace)
        netns.set_sysctls(namespace, QUIET_SYSCTLS)
        # Created from inside the router with its peer end placed straight into the host: never in our namespace.
        netns.ip("-n", hub, "link", "add", device, "type", "veth", "peer", "name", HOST_DEVICE, "netns", namespace)
        ip_batch(namespace, [
            f"addr add {address}/32 dev {HOST_DEVICE}",
            f"link set {HOST_DEVICE} up",
            f"route add {netns.GATEWAY}/32 dev {HOST_DEVICE} scope link",
            f"route add {netns.SUBNET}.0/24 via {netns.GATEWAY} dev {HOST_DEVICE} src {address}",
        ])
        hub_lines += [
            f"addr add {netns.GATEWAY}/32 dev {device}",
            f"link set {device} up",
            f"route add {address}/32 dev {device}",
        ]
    ip_batch(hub, hub_lines)
