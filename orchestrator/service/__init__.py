"""The live swarm-orchestrator: placement on running servers, JFFC dispatch with leases."""
