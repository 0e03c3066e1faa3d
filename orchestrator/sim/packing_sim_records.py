"""What the KV-packing simulator takes and gives: sessions, a run's configuration, per-epoch records, the summary."""

from __future__ import annotations

from dataclasses import dataclass, field

from orchestrator.packing import MigrationCosts


@dataclass(frozen=True)
class SessionSpec:
    """One request: when it arrives (s), its prompt and its output in tokens.

    Replaying a live run, a session may carry its own measured decode speed, and the bin its client's route put it
    on (`landed`): the packer still allocates it, and where that is not `landed` the session moves there.
    """

    session_id: str
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    decode_tokens_per_s: float | None = None  # None: the run's `decode_tokens_per_s`
    landed: str | None = None  # None: it starts on the bin the packer allocates

    @property
    def final_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens


@dataclass(frozen=True)
class PackingSimConfig:
    """One run's cluster: pages per bin, tokens per page, KV bytes per token, decode speed and migration costs."""

    capacity_pages: int
    tokens_per_page: int
    kv_bytes_per_token: int  # of a session, over all its blocks
    decode_tokens_per_s: float
    bandwidth_bytes_per_s: float
    rtt_ms: float
    prefill_ms_per_token: float
    epoch_s: float = 1.0
    batching: bool = True
    comm_budget_share: float = 0.5
    comp_budget_share: float = 0.25
    check_invariants: bool = False  # the packer's own check after every epoch (slow; for tests)
    reserve_final: bool = False  # spec 5.2 phase 1: a session takes its final size at admission and never grows
    blocks: int = 1  # blocks a session's KV spans on a bin: each holds ceil(tokens / tokens_per_page) pages
    # A move waits while its destination's KV (sessions on it now, moves into it running) leaves no room for it, as
    # a live segment's leader holds it back; False: moves never wait for room (a bin may hold more than C meanwhile)
    moves_wait_for_room: bool = False

    def __post_init__(self) -> None:
        if min(self.capacity_pages, self.tokens_per_page, self.kv_bytes_per_token, self.blocks) < 1:
            raise ValueError("capacity, tokens per page, KV bytes per token and blocks must be >= 1")
        if self.decode_tokens_per_s <= 0 or self.epoch_s <= 0 or self.bandwidth_bytes_per_s <= 0:
            raise ValueError("the decode rate, the epoch and the bandwidth must be > 0")
        if self.rtt_ms < 0 or self.prefill_ms_per_token <= 0:
            raise ValueError("the RTT must be >= 0 and the prefill time per token > 0")

    @property
    def costs(self) -> MigrationCosts:
        return MigrationCosts(
            self.kv_bytes_per_token,
            self.bandwidth_bytes_per_s,
            self.rtt_ms / 1000.0,
            self.prefill_ms_per_token / 1000.0,
            self.epoch_s,
            self.comm_budget_share,
            self.comp_budget_share,
        )

    def pages(self, tokens: int) -> int:
        return self.blocks * -(-tokens // self.tokens_per_page)


@dataclass(frozen=True)
class EpochRecord:
    """One epoch from `t_s`: the state at its start, integrals over it, and what happened at its boundary."""

    t_s: float
    active_bins: int  # at the start, moves in flight included
    packed_bins: int  # the packer's active bins only
    active_bin_s: float  # active bin-seconds over the epoch
    pages_held: int  # at the start: the packer's loads plus the pages held by moving sessions at their source
    page_s: float  # pages held x seconds over the epoch
    packed_pages: int  # the packer's loads only
    kv_pages: int  # at the start: the pages sessions' KV fills (below `packed_pages` when sizes are reserved)
    kv_page_s: float  # KV-filled pages x seconds over the epoch, both sides of moves counted
    arrivals: int
    departures: int
    rejected: int
    planned_moves: int  # moves the packer's plan executes (pruned if batching)
    unbatched_moves: int  # moves the same operations cause one by one
    kv_migrations: int
    replay_migrations: int
    deferred: int


@dataclass(frozen=True)
class PackingSimSummary:
    """A run's figures: active bins, utilization, migrations, what batching avoided, what did not fit."""

    packer: str
    batching: bool
    sessions: int
    completed: int
    rejected: int
    evicted: int
    duration_s: float
    peak_active_bins: int  # moves in flight included
    peak_packed_bins: int  # the packer's own active bins
    peak_bins_lower_bound: int  # max over epochs of ceil(packed pages / C): no packer of these sizes needs fewer
    mean_active_bins: float
    mean_utilization: float  # page-seconds held / (C x active bin-seconds), both sides of moves counted
    mean_packed_utilization: float  # the same with the packer's loads only
    mean_kv_utilization: float  # page-seconds the KV fills / (C x active bin-seconds): reserved-but-empty pages idle
    migrations: int
    kv_migrations: int
    replay_migrations: int
    oversized_migrations: int
    migrations_per_s: float
    mean_migration_s: float
    planned_moves: int
    unbatched_moves: int
    moves_avoided_by_batching: int
    deferrals: int
    max_packed_load_pages: int
    max_held_pages: int  # the most pages a bin held at a boundary, moves in flight included (may pass C)


@dataclass
class PackingSimResult:
    summary: PackingSimSummary
    epochs: list[EpochRecord]
    departed_s: dict[str, float]  # session -> the boundary it departed at (completed or evicted)
    rejected: list[str] = field(default_factory=list)
    evicted: list[str] = field(default_factory=list)
