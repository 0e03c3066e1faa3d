"""Emulated GPU servers: a profile's per-block times and memory, scaled to the served model; batches are held for the
profile's time; the record says the server is emulated."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from server.config import ServerConfig
from server.emulated_gpu import PROFILES, REFERENCE_KV_BYTES_PER_TOKEN, GpuProfile, load_profile
from server.server import SwarmServer
from server.sessions import Step, StepResult
from swarm.memory import ParamsOwner
from swarm.model.paged_kv import PagedBatch, SequenceChunk


def test_profiles_give_per_block_times_and_memory_in_the_served_models_scale(tmp_path: Path) -> None:
    fast, slow = PROFILES["a100-3g.40gb"], PROFILES["a100-2g.20gb"]
    assert fast.decode_ms(1) < slow.decode_ms(1) and fast.prefill_ms_per_token < slow.prefill_ms_per_token
    assert fast.decode_ms(8) == pytest.approx(fast.decode_ms_base + 8 * fast.decode_ms_per_row)
    kv_bytes = REFERENCE_KV_BYTES_PER_TOKEN // 64
    assert fast.pool_bytes(kv_bytes) == pytest.approx(40e9 / 64, rel=1e-9)
    assert slow.pool_bytes(kv_bytes) == pytest.approx(fast.pool_bytes(kv_bytes) / 2, rel=1e-9)
    batch = PagedBatch((
        SequenceChunk(0, 1, 10, 0, 4, {}), SequenceChunk(1, 1, 20, 2, 4, {}), SequenceChunk(2, 16, 0, 0, 2, {}),
    ))
    # blocks 0-1: one decode row (11 tokens of history with its new one) and 16 prefill tokens, whose compute hides
    # under the step's memory traffic; blocks 2-3: two decode rows, 11 + 21 tokens of history: each row reads its own
    # KV, the parameters are read once
    expected = 2 * fast.decode_ms(1, 11) + 2 * fast.decode_ms(2, 16)
    assert fast.batch_ms(batch) == pytest.approx(expected)
    assert fast.block_ms(batch, 1) == pytest.approx(fast.decode_ms(1, 11))
    assert fast.block_ms(batch, 3) == pytest.approx(fast.decode_ms(2, 16)) and fast.block_ms(batch, 4) == 0
    assert fast.decode_ms(2) == pytest.approx(fast.decode_ms_base + 2 * fast.decode_ms_per_row)  # rows of 2048
    # the roofline: a long chunk is bound by its compute, a short one alone by reading the parameters
    long_chunk = PagedBatch((SequenceChunk(0, 512, 0, 0, 1, {}), SequenceChunk(1, 1, 99, 0, 1, {})))
    assert fast.block_ms(long_chunk, 0) == pytest.approx(513 * fast.prefill_ms_per_token)
    assert fast.chunk_ms_per_token(512) == pytest.approx(fast.prefill_ms_per_token)
    assert fast.chunk_ms_per_token(16) == pytest.approx(fast.decode_ms_base / 16)
    custom = tmp_path / "tiny-gpu.json"
    custom.write_text(json.dumps({"memory_gb": 1, "prefill_ms_per_token": 0.5, "decode_ms_base": 2,
                                  "decode_ms_per_row": 0.25}))
    assert load_profile(str(custom)) == GpuProfile("tiny-gpu", 1, 0.5, 2, 0.25)
    with pytest.raises(ValueError, match="unknown GPU profile"):
        load_profile("h100-nonexistent")


def test_an_emulated_server_holds_its_batches_for_the_profiles_time(tiny_llama: Path, tmp_path: Path) -> None:
    profile_path = tmp_path / "slow-gpu.json"
    profile_path.write_text(json.dumps({"memory_gb": 2, "prefill_ms_per_token": 1.0, "decode_ms_base": 20.0,
                                        "decode_ms_per_row": 5.0}))
    config = ServerConfig(blocks="0:4", model=str(tiny_llama), emulate_gpu=str(profile_path), page_bytes=4096)
    server = SwarmServer(config)
    profile = server.gpu_profile
    assert profile is not None and server.block_decode_ms == {1: 25.0, 8: 60.0, 32: 180.0}
    assert server.block_prefill_ms_per_token == 1.0  # a 128-token chunk, per token, as the profile times it
    kv_bytes = server.blocks.kv_bytes_per_token()
    assert server.pool.pages_total == profile.pool_bytes(kv_bytes) // 4096
    block_pages = len(server.pool.pages_of(ParamsOwner(0)))
    assert block_pages == -(-profile.block_bytes(kv_bytes) // 4096) and server.block_bytes == block_pages * 4096

    async def step_through() -> StepResult:
        server.scheduler.start()
        session = server.sessions.open("s", 0, 4, batch=1, max_length=64)
        hidden = torch.randn(1, 3, 64)
        server.sessions.grow(session, 3)
        result: asyncio.Future[StepResult] = asyncio.get_running_loop().create_future()
        step = Step(session, "0", hidden, result)
        session.running = step
        server.scheduler.submit(step)
        try:
            return await result
        finally:
            await server.scheduler.stop()

    result = asyncio.run(step_through())
    assert result.compute_ms >= 4 * 3 * 1.0  # 3 prompt tokens through 4 blocks at 1 ms per token and block
