"""netem: emulate a wide-area swarm on one machine with network namespaces and per-pair delays.

`Topology` (hosts, RTT matrix, bandwidth, loss) from files, RIPE Atlas (derived) or seeded generators;
`EmulatedNetwork` wires a namespace per host to a router namespace and delays traffic with `tc` netem where the
kernel has it, else with the user-space fabric; `netem.probe` measures what the emulation does.
"""

from netem.network import EmulatedNetwork, down
from netem.topology import Topology, TopologyError

__all__ = ["EmulatedNetwork", "Topology", "TopologyError", "down"]
