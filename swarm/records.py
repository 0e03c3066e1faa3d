"""Pydantic models of what servers announce on the DHT, validated strictly because any peer can write there."""

from __future__ import annotations

import logging
from enum import StrEnum
from importlib.metadata import PackageNotFoundError, version
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

logger = logging.getLogger(__name__)

LONG_PREFILL_HISTORY_TOKENS = 1920  # history before the long prefill chunk servers measure (it ends at 2,048)
MAX_BLOCKS = 100_000
MAX_ADDRS = 16
MAX_ORCHESTRATORS = 4
MAX_BATCH_TIMINGS = 8
MAX_PUBLIC_NAME_CHARS = 64
MAX_ID_CHARS = 128
MAX_MODEL_ID_CHARS = 256
MAX_ADDR_CHARS = 256
MAX_TAG_CHARS = 32
MAX_VERSION_CHARS = 64


def _software_version() -> str:
    try:
        return version("chainswarm")
    except PackageNotFoundError:
        return "0.0.0"


SOFTWARE_VERSION = _software_version()

AddrText = Annotated[str, Field(min_length=1, max_length=MAX_ADDR_CHARS)]


class ServerState(StrEnum):
    """Where a server is in its lifetime; clients route new sessions only to `online` servers."""

    joining = "joining"  # started, hosting no blocks yet (waiting for its orchestrator's assignment)
    online = "online"
    draining = "draining"


class BatchTiming(BaseModel):
    """A measured decode step of one block at one batch size."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    batch: int = Field(gt=0, le=4096)
    ms: float = Field(ge=0, allow_inf_nan=False)


class ServerRecord(BaseModel):
    """What one server announces: the blocks it hosts, its memory pages and its measured speed."""

    # Strict: a record comes from an untrusted peer, so "3" is not silently an int and True is not 1.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    peer_id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    model_id: str = Field(min_length=1, max_length=MAX_MODEL_ID_CHARS)
    block_start: int = Field(ge=0, lt=MAX_BLOCKS)
    block_end: int = Field(ge=0, le=MAX_BLOCKS)
    # Not strict: the wire carries the enum's string value.
    state: ServerState = Field(strict=False)
    pages_total: int = Field(ge=0)
    pages_params: int = Field(ge=0)
    pages_kv: int = Field(ge=0)
    pages_free: int = Field(ge=0)
    sessions_fit: int = Field(
        ge=0, description="new sessions over every hosted block that the server's headroom rule admits now"
    )
    page_bytes: int = Field(gt=0)
    kv_bytes_per_token: int = Field(ge=0, description="KV bytes one token takes in one block")
    block_bytes: int = Field(default=0, ge=0, description="bytes of one block's parameters as this server holds them")
    block_compute_ms: float = Field(ge=0, allow_inf_nan=False, description="mean time of one block for one token")
    block_decode_ms: list[BatchTiming] = Field(
        default_factory=list, max_length=MAX_BATCH_TIMINGS,
        description="measured time of one block for a decode step of `batch` sessions, by batch size",
    )
    block_prefill_ms_per_token: float | None = Field(
        default=None, ge=0, allow_inf_nan=False,
        description="measured time of one block per prompt token in a prefill chunk (None: not measured)",
    )
    block_prefill_ms_per_token_long: float | None = Field(
        default=None, ge=0, allow_inf_nan=False,
        description=f"the same after {LONG_PREFILL_HISTORY_TOKENS} tokens of history (None: not measured)",
    )
    network_mbps: float | None = Field(ge=0, allow_inf_nan=False, description="measured inbound throughput")
    session_count: int = Field(ge=0)
    max_length: int = Field(gt=0)
    dtype: str = Field(min_length=1, max_length=MAX_TAG_CHARS)
    quant: str = Field(min_length=1, max_length=MAX_TAG_CHARS)
    version: str = Field(min_length=1, max_length=MAX_VERSION_CHARS)
    public_name: str | None = Field(max_length=MAX_PUBLIC_NAME_CHARS)
    addrs: list[AddrText] = Field(max_length=MAX_ADDRS)
    emulated_gpu: str | None = Field(
        default=None, max_length=MAX_TAG_CHARS, description="the GPU profile an emulated server plays (experiments)"
    )
    accepting: bool = Field(
        default=True, description="takes new sessions; false: a standby its segment's KV packing emptied"
    )
    kv_demand_pages: int = Field(
        default=0, ge=0,
        description="KV pages asked beyond those held: the open sessions' expected growth and what the sessions "
                    "refused for room in the last 5 s (their clients may still wait) would have taken (KunServe's "
                    "drop trigger)",
    )
    kv_packed_pages: int = Field(
        default=0, ge=0,
        description="KV pages the open sessions hold, a session that took no step yet counted at its announced "
                    "prompt (it opened with one page per block): the KV a drop's victims bring to the members that "
                    "keep their blocks (KunServe's hold for the exchange); 0 from a server before this field",
    )
    restorable_start: int | None = Field(
        default=None, ge=0, lt=MAX_BLOCKS,
        description="with restorable_end: the range served before this server dropped blocks (KunServe), which it can "
                    "load back from its local checkpoint; None while nothing is dropped",
    )
    restorable_end: int | None = Field(default=None, ge=0, le=MAX_BLOCKS)
    segment_dropping: bool = Field(
        default=False, description="takes part in its segment's drops without an orchestrator (`--kv-dropping`): "
        "its segment's leader is elected among, and plans for, the servers that do; false from a server before this "
        "field",
    )
    reshaping: bool = Field(
        default=False, description="whether a KV exchange after a drop, or the merges after a restore, run now "
        "(the server takes new sessions meanwhile)",
    )
    moved_in: int = Field(default=0, ge=0, description="sessions that arrived by migration (KV or replay) so far")
    moved_out: int = Field(default=0, ge=0, description="sessions that left by migration (KV or replay) so far")
    drops: int = Field(default=0, ge=0, description="times this server dropped blocks (KunServe) so far")
    restores: int = Field(default=0, ge=0, description="times this server restored dropped blocks so far")
    orchestrators: list[Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS)]] = Field(
        default_factory=list, max_length=MAX_ORCHESTRATORS,
        description="peer ids of the orchestrators whose block assignments this server follows",
    )

    @model_validator(mode="after")
    def _check_consistency(self) -> ServerRecord:
        # Only a server still waiting for its first blocks (from its orchestrator) announces an empty range.
        empty = self.block_start == self.block_end
        if self.block_start > self.block_end or (empty and self.state != ServerState.joining):
            raise ValueError(f"empty block range [{self.block_start}, {self.block_end}) of a server {self.state.value}")
        pages_accounted = self.pages_params + self.pages_kv + self.pages_free
        if pages_accounted != self.pages_total:
            raise ValueError(
                f"pages_params + pages_kv + pages_free = {pages_accounted} != pages_total {self.pages_total}"
            )
        start, end = self.restorable_start, self.restorable_end
        if (start, end) != (None, None) and (
            start is None or end is None or not start <= self.block_start < self.block_end <= end
        ):
            raise ValueError(f"restorable range [{start}, {end}) must hold the served "
                             f"[{self.block_start}, {self.block_end})")
        batches = [timing.batch for timing in self.block_decode_ms]
        if batches != sorted(set(batches)):
            raise ValueError("block_decode_ms must list distinct batch sizes in ascending order")
        return self

    @property
    def block_range(self) -> range:
        """Gives the hosted block indices."""
        return range(self.block_start, self.block_end)

    def to_wire(self) -> dict[str, Any]:
        """Gives a JSON- and msgpack-safe dict of this record."""
        return self.model_dump(mode="json")

    @staticmethod
    def from_wire(obj: object) -> ServerRecord | None:
        """Gives the record in `obj`, or None when it does not validate (logged at debug level)."""
        if not isinstance(obj, dict):
            logger.debug("dropping server record that is not a map: %.200r", obj)
            return None
        try:
            return ServerRecord.model_validate(obj)
        except ValidationError as error:
            logger.debug("dropping invalid server record: %s", error)
            return None


MAX_NEXT_HOPS = 64


class NextHop(BaseModel):
    """A later server of a step's chain: where a server pushes its output so that it skips the client's leg."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    peer_id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    session_id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    addrs: list[AddrText] = Field(max_length=MAX_ADDRS)
    # the blocks the client runs there: a server that split or merged the session since refuses the step
    start: int | None = Field(default=None, ge=0, lt=MAX_BLOCKS)
    end: int | None = Field(default=None, ge=0, le=MAX_BLOCKS)

    def to_wire(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude_none=True)

    @staticmethod
    def list_from_wire(obj: object) -> list[NextHop]:
        """Gives the hops in `obj` (a list of maps); raises ValueError naming what does not validate."""
        if not isinstance(obj, list) or len(obj) > MAX_NEXT_HOPS:
            raise ValueError(f"'next' must be a list of at most {MAX_NEXT_HOPS} hops, got {obj!r:.100}")
        try:
            return [NextHop.model_validate(hop) for hop in obj]
        except ValidationError as error:
            raise ValueError(f"invalid hop in 'next': {error}") from None


class OrchestratorRecord(BaseModel):
    """What an orchestrator announces for one model: where to reach it, and since when it runs (the earliest live
    one is the active one; the others stand by and take over when its record expires)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    peer_id: str = Field(min_length=1, max_length=MAX_ID_CHARS)
    model_id: str = Field(min_length=1, max_length=MAX_MODEL_ID_CHARS)
    started_at: float = Field(ge=0, allow_inf_nan=False, description="DHT time the orchestrator started")
    version: str = Field(min_length=1, max_length=MAX_VERSION_CHARS)
    addrs: list[AddrText] = Field(max_length=MAX_ADDRS)

    def to_wire(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    @staticmethod
    def from_wire(obj: object) -> OrchestratorRecord | None:
        """Gives the record in `obj`, or None when it does not validate."""
        if not isinstance(obj, dict):
            return None
        try:
            return OrchestratorRecord.model_validate(obj)
        except ValidationError as error:
            logger.debug("dropping invalid orchestrator record: %s", error)
            return None


def active_orchestrator(records: dict[str, OrchestratorRecord]) -> OrchestratorRecord | None:
    """Gives the active orchestrator among live records: the one that started first (ties: the lowest peer id)."""
    return min(records.values(), key=lambda record: (record.started_at, record.peer_id), default=None)
