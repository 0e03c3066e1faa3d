"""The discrete-event simulator behind `swarm-sim`: workloads, the event engine, metrics, presets and experiments."""
