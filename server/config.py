"""Settings of one swarm-server process; every period and timeout is a setting, not a constant in code."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.admission import DEFAULT_CLIENT_KV_SHARE, DEFAULT_CLIENT_MAX_SESSIONS, DEFAULT_HEADROOM_TOKENS
from server.migration import IMPORT_IDLE_S, KV_CHUNK_BYTES
from swarm.memory import DEFAULT_PAGE_BYTES
from swarm.model import DEFAULT_MODEL


@dataclass
class ServerConfig:
    """What `swarm-server` was asked to host and how it behaves."""

    blocks: str | None = None  # "START:END"; None: blocks come from `orchestrator`, or the server chooses them
    model: str = DEFAULT_MODEL
    orchestrators: tuple[str, ...] = ()  # peer ids of the orchestrators whose assignments this server follows (an
    # active one and its standbys); empty: it follows none
    num_blocks: int | None = None  # blocks a self-choosing server hosts; None: as many as memory holds with KV room
    balance_quality: float = 0.75  # a self-choosing server moves when its best span would raise the swarm's
    # throughput (that of its slowest block) by more than 1 / balance_quality (Petals' rule and default)
    rebalance_period_s: float = 60.0  # how often a self-choosing server checks whether to move
    block_change_timeout_s: float = 120.0  # how long a range change may wait for leaving blocks to free pages
    emulate_gpu: str | None = None  # a GPU profile (server.emulated_gpu) whose times and memory this server plays
    memory: str | None = None
    page_bytes: int = DEFAULT_PAGE_BYTES
    initial_peers: list[str] = field(default_factory=list)
    host_maddrs: list[str] = field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"])
    announce_maddrs: list[str] = field(default_factory=list)
    identity: Path | None = None
    public_name: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    quant: str = "none"
    max_length: int = 2048
    session_timeout_s: float = 300.0
    announce_period_s: float = 10.0
    record_ttl_s: float = 30.0
    metrics_port: int | None = None  # serve Prometheus metrics there (0: any free port)
    metrics_host: str = "127.0.0.1"
    drain_timeout_s: float = 10.0
    push_timeout_s: float = 10.0
    migration_chunk_bytes: int = KV_CHUNK_BYTES  # KV bytes one import_kv frame of a migration carries at most
    import_idle_timeout_s: float = IMPORT_IDLE_S  # an import whose source sent nothing this long is dropped
    kv_packing: str | None = None  # "mell", "bf", "wf" or "lb": its segment packs sessions (packing.segment_loop)
    packing_epoch_s: float = 1.0  # how often the segment's leader packs
    kv_dropping: bool = False  # without an orchestrator: its segment drops blocks under a KV burst (KunServe)
    drop_period_s: float = 0.5  # how often the segment's leader looks at its demand
    restore_after_s: float = 10.0  # a drop this old may be restored once the demand fits
    restore_calm_s: float = 15.0  # and once it has fitted for this long
    kv_exchange: str = "auto"  # how a drop's victims reach the blocks' keepers: auto, blocking, live or replay
    max_batch_tokens: int | None = None  # tokens one batch computes at most (decode steps, then prefill chunks);
    # None: the device's default (server.scheduler.DEFAULT_MAX_BATCH_TOKENS)
    kv_headroom_tokens: int = DEFAULT_HEADROOM_TOKENS  # growth expected of each running session, for admission
    client_max_sessions: int = DEFAULT_CLIENT_MAX_SESSIONS  # open sessions one client may hold here (0: no cap)
    client_kv_share: float = DEFAULT_CLIENT_KV_SHARE  # share of the KV pages one client may hold here (1: no cap)
    inline_step_ms: float = 50.0  # a step expected within this computes on the event loop when it is the only one
    batch_trace: Path | None = None  # append a JSON line per batch computed there (`server.batch_trace`)
    torch_threads: int = 0  # intra-op threads of a step; 0 keeps torch's default
    max_frame_bytes: int = 64 << 20
