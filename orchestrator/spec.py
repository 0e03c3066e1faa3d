"""The swarm spec: a JSON file describing a model, its candidate servers and the load, validated with clear errors.

```json
{"model": {"blocks": 70, "block_gb": 1.32, "cache_gb": 0.11},
 "servers": [{"name": "a", "memory_gb": 40, "tau_c_ms": 30, "tau_p_ms": 109}],
 "arrival_rate": 0.2, "rho_bar": 0.7}
```
`block_gb` is one block's parameters, `cache_gb` one block's KV cache for one job; `tau_c_ms` is a job's whole
communication time with the server and `tau_p_ms` its whole computation time through one block (alone on the
server); the optional `tau_p_batch_ms` (default 0, the paper's model) is how much `tau_p_ms` grows per other job the
server runs at once, and makes JFFC and the simulator load-dependent; the optional `tau_p_prefill_ms` (default 0) is
the prompt's share of `tau_p_ms`, which jobs prefilling on the server at once share in the simulator;
`arrival_rate` is in jobs per second;
`rho_bar` (default 0.7) is the target maximum load.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from orchestrator.swarm_model import ModelSpec, ServerSpec, SwarmModel, per_ms

DEFAULT_RHO_BAR = 0.7


class SwarmSpecError(ValueError):
    """A swarm spec that cannot be read or does not validate; the message names the file and the field."""


class _Strict(BaseModel):
    # strict: "40" is not silently 40 and true is not 1; floats still accept integers
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class ModelEntry(_Strict):
    blocks: int = Field(ge=1, le=100_000, description="number of blocks L")
    block_gb: float = Field(gt=0, allow_inf_nan=False, description="parameters of one block, GB (s_m)")
    cache_gb: float = Field(gt=0, allow_inf_nan=False, description="KV cache of one block for one job, GB (s_c)")


class ServerEntry(_Strict):
    name: str = Field(min_length=1, max_length=128)
    memory_gb: float = Field(ge=0, allow_inf_nan=False, description="memory for blocks and caches, GB (M_j)")
    tau_c_ms: float = Field(ge=0, allow_inf_nan=False, description="communication time of one job, ms")
    tau_p_ms: float = Field(gt=0, allow_inf_nan=False, description="computation time of one job per block, ms")
    tau_p_batch_ms: float = Field(default=0.0, ge=0, allow_inf_nan=False,
                                  description="growth of tau_p_ms per other job on the server, ms")
    tau_p_prefill_ms: float = Field(default=0.0, ge=0, allow_inf_nan=False,
                                    description="the prompt's prefill share of tau_p_ms, ms")

    @model_validator(mode="after")
    def _prefill_within_tau_p(self) -> ServerEntry:
        if self.tau_p_prefill_ms > self.tau_p_ms:
            raise ValueError(f"tau_p_prefill_ms {self.tau_p_prefill_ms} exceeds tau_p_ms {self.tau_p_ms}")
        return self


class SwarmSpec(_Strict):
    """A validated swarm spec."""

    model: ModelEntry
    servers: list[ServerEntry] = Field(min_length=1)
    arrival_rate: float = Field(gt=0, allow_inf_nan=False, description="jobs per second")
    rho_bar: float = Field(default=DEFAULT_RHO_BAR, gt=0, le=1, allow_inf_nan=False)

    @field_validator("servers")
    @classmethod
    def _unique_names(cls, servers: list[ServerEntry]) -> list[ServerEntry]:
        seen: set[str] = set()
        for server in servers:
            if server.name in seen:
                raise ValueError(f"server name {server.name!r} appears more than once")
            seen.add(server.name)
        return servers

    def swarm(self) -> SwarmModel:
        """Gives the swarm model (servers in the spec's order)."""
        model = ModelSpec(self.model.blocks, self.model.block_gb, self.model.cache_gb)
        servers = tuple(ServerSpec(s.name, s.memory_gb, s.tau_c_ms, s.tau_p_ms, s.tau_p_batch_ms, s.tau_p_prefill_ms)
                        for s in self.servers)
        return SwarmModel(model, servers)

    @property
    def arrival_rate_per_ms(self) -> float:
        return per_ms(self.arrival_rate)


def _location(loc: tuple[int | str, ...]) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "(top level)"


def parse_swarm_spec(data: Any, *, source: str = "swarm spec") -> SwarmSpec:
    """Gives the validated spec of already-parsed JSON `data`; SwarmSpecError lists every problem, one a line."""
    try:
        return SwarmSpec.model_validate(data)
    except ValidationError as error:
        problems = [f"  {_location(item['loc'])}: {item['msg']}" for item in error.errors()]
        raise SwarmSpecError(f"{source} is not a valid swarm spec:\n" + "\n".join(problems)) from None


def load_swarm_spec(path: str | Path) -> SwarmSpec:
    """Gives the validated spec in the JSON file at `path`; SwarmSpecError says what is wrong and where."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise SwarmSpecError(f"cannot read swarm spec {path}: {error.strerror or error}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise SwarmSpecError(f"{path} is not JSON: {error.msg} at line {error.lineno}, column {error.colno}") from None
    return parse_swarm_spec(data, source=str(path))
