"""The swarm client: a causal LM whose transformer blocks run on the swarm, with sessions, routing and failover."""

from __future__ import annotations

from client.inference import InferenceSession, SpanTimings
from client.model import DistributedModelForCausalLM
from client.swarm_client import ClientConfig, SwarmClient

__all__ = ["ClientConfig", "DistributedModelForCausalLM", "InferenceSession", "SpanTimings", "SwarmClient"]
