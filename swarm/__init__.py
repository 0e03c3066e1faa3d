"""swarm."""
