"""The adapter between what a live swarm announces and measures and the chain-composition model's inputs.

From each server's `ServerRecord` (memory pages, page size, block size, measured per-block step times), the RTT the
orchestrator measured to it, and the job sizes and arrival rate it observed, this builds the `SwarmModel` that
GBP-CR, GCA, the tuning of c and JFFC take (spec: `shared/specs/chain-composition.md`):
- M_j: the server's whole pool, `pages_total * page_bytes` (the placement decides what holds parameters);
- s_m: one block's parameters in whole pages (the largest over the servers, so that a plan fits each of them);
- s_c: one job's KV in one block in whole pages, at the observed mean prompt + output tokens. The paper reserves
  the maximum sequence length (`cache_tokens` plans for that); with paged KV a job holds pages only for its length,
  and each server's headroom rule turns away what does not fit (the client then fails over);
- tau_p[j]: one job through one block: prompt tokens x the measured prefill time per token (of a chunk) + output
  tokens x the decode step at batch 1;
- tau_p_batch[j] (our extension, `ServerSpec.tau_p_batch_ms`): how much tau_p grows per other job the server
  batches with it: output tokens x the measured decode step's growth per row (between the smallest and the largest
  batch the record announces);
- tau_p_prefill[j] (our extension, `ServerSpec.tau_p_prefill_ms`): the prompt's part of tau_p, which jobs
  prefilling on the server at once share (the simulator's world; policies rank by tau_p);
- tau_c[j]: one job's communication with server j: one round trip per output token plus one for the prompt
  (every step of a job crosses the link), at the measured RTT. The paper counts one RTT + 18 ms per job, which
  fits its relayed setting; ours is what a job's steps actually wait for.
Times in ms, memory in GB (10^9 bytes), as in `swarm_model`.

Pure: records and numbers in, a model out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import pairwise

from orchestrator.swarm_model import ModelSpec, ServerSpec, SwarmModel
from swarm.memory import kv_pages_for
from swarm.records import LONG_PREFILL_HISTORY_TOKENS, ServerRecord

GB = 1e9
MIN_TIME_MS = 1e-6  # a server that announces a zero step time still costs something per block


@dataclass(frozen=True)
class JobSizes:
    """The mean job the orchestrator plans for: prompt tokens and generated tokens."""

    prompt_tokens: float
    output_tokens: float

    def __post_init__(self) -> None:
        if not (self.prompt_tokens >= 1 and self.output_tokens >= 1):
            raise ValueError(f"a job has at least one prompt and one output token, got {self}")

    @property
    def total_tokens(self) -> int:
        return math.ceil(self.prompt_tokens + self.output_tokens)


def block_pages_bytes(record: ServerRecord) -> int:
    """Gives the bytes of one block's parameters on `record`'s server, in whole pages."""
    return kv_pages_for(record.block_bytes, record.page_bytes) * record.page_bytes


def job_cache_bytes(record: ServerRecord, tokens: int) -> int:
    """Gives the bytes `tokens` of one job's KV take in one block on `record`'s server, in whole pages."""
    tokens_per_page = max(1, record.page_bytes // max(1, record.kv_bytes_per_token))
    return kv_pages_for(tokens, tokens_per_page) * record.page_bytes


def decode_step_ms(record: ServerRecord, batch: int = 1) -> float:
    """Gives one block's decode step at `batch` sessions: measured where announced, else interpolated linearly
    between announced batch sizes (or the per-token compute time when none is announced)."""
    timings = sorted((timing.batch, timing.ms) for timing in record.block_decode_ms)
    if not timings:
        return max(record.block_compute_ms, MIN_TIME_MS)
    for (low_batch, low_ms), (high_batch, high_ms) in pairwise(timings):
        if low_batch <= batch <= high_batch:
            return low_ms + (high_ms - low_ms) * (batch - low_batch) / (high_batch - low_batch)
    return timings[0][1] if batch < timings[0][0] else timings[-1][1]


def decode_slope_ms(record: ServerRecord) -> float:
    """Gives one block's decode step growth per session in the batch: the slope between the smallest and the largest
    announced batch (0 when fewer than two are announced, or the step does not grow)."""
    timings = sorted((timing.batch, timing.ms) for timing in record.block_decode_ms)
    if len(timings) < 2:
        return 0.0
    (low_batch, low_ms), (high_batch, high_ms) = timings[0], timings[-1]
    return max(0.0, (high_ms - low_ms) / (high_batch - low_batch))


def prefill_ms_per_token(record: ServerRecord) -> float:
    """Gives one block's prefill time per prompt token: as measured on a prefill chunk, else (a server that does not
    announce it) the largest measured decode batch's time per token."""
    if record.block_prefill_ms_per_token is not None:
        return max(record.block_prefill_ms_per_token, MIN_TIME_MS)
    if not record.block_decode_ms:
        return max(record.block_compute_ms, MIN_TIME_MS)
    largest = max(record.block_decode_ms, key=lambda timing: timing.batch)
    return largest.ms / largest.batch


def replay_prefill_ms_per_token(record: ServerRecord, tokens: int) -> float:
    """Gives one block's mean prefill time per token over a prompt of `tokens` tokens (a replay's history): the
    measured time grows linearly with the history, from a chunk at the start of a sequence to one after
    LONG_PREFILL_HISTORY_TOKENS (attention reads the whole history), so the mean is the time at half the prompt."""
    start = prefill_ms_per_token(record)
    if record.block_prefill_ms_per_token_long is None:
        return start
    growth = (record.block_prefill_ms_per_token_long - start) / LONG_PREFILL_HISTORY_TOKENS
    return max(start + growth * tokens / 2, MIN_TIME_MS)


def server_spec(record: ServerRecord, rtt_ms: float, jobs: JobSizes, *, batching: bool = True) -> ServerSpec:
    """Gives server j of the model: its memory, tau_c, tau_p and (with `batching`) tau_p_batch and tau_p_prefill for
    the mean job."""
    prefill = jobs.prompt_tokens * prefill_ms_per_token(record)
    tau_p = max(prefill + jobs.output_tokens * decode_step_ms(record, 1), MIN_TIME_MS)
    tau_c = (jobs.output_tokens + 1) * max(rtt_ms, 0.0)
    return ServerSpec(
        name=record.peer_id, memory_gb=record.pages_total * record.page_bytes / GB, tau_c_ms=tau_c, tau_p_ms=tau_p,
        tau_p_batch_ms=jobs.output_tokens * decode_slope_ms(record) if batching else 0.0,
        tau_p_prefill_ms=prefill if batching else 0.0,
    )


def swarm_model(
    records: Mapping[str, ServerRecord], rtt_ms: Mapping[str, float], jobs: JobSizes, num_blocks: int,
    *, cache_tokens: int | None = None, batching: bool = True,
) -> SwarmModel:
    """Gives the chain-composition model of the servers in `records` (peer ids in sorted order) for `num_blocks`
    blocks and the mean job; a server never measured gets the largest RTT measured (or 0 if none is). s_c is the
    mean job's KV unless `cache_tokens` fixes the tokens a job is planned to hold (the paper: the maximum length).
    Without `batching`, servers get no batch slope: the paper's model, where a chain runs c jobs at the speed of
    one."""
    if not records:
        raise ValueError("no servers to model")
    fallback_rtt = max(rtt_ms.values(), default=0.0)
    ordered = [records[peer] for peer in sorted(records)]
    model = ModelSpec(
        blocks=num_blocks,
        block_gb=max(block_pages_bytes(record) for record in ordered) / GB,
        cache_gb=max(job_cache_bytes(record, cache_tokens or jobs.total_tokens) for record in ordered) / GB,
    )
    servers = tuple(server_spec(record, rtt_ms.get(record.peer_id, fallback_rtt), jobs, batching=batching)
                    for record in ordered)
    return SwarmModel(model, servers)
