"""Block ranges load only their own weights and, chained, reproduce the Hugging Face model exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from swarm.errors import InvalidBlockRange, UnsupportedArchitecture
from swarm.memory import KVOwner, PagePool, ParamsOwner
from swarm.model import BlockRange, ClientHead, get_family, parse_block_range, resolve_model
from swarm.model import checkpoint as checkpoint_module
from tests.tiny_models import tiny_config, write_tiny_checkpoint


def run_split(path: Path, splits: list[tuple[int, int]], input_ids: torch.Tensor, steps: int, **block_kwargs):
    """Gives greedy tokens and last logits of the model run as chained block ranges with KV caches."""
    source = resolve_model(str(path))
    head = ClientHead(source)
    ranges = [BlockRange(source, start, end, **block_kwargs) for start, end in splits]
    caches = [r.new_caches(r.start, r.end, batch=input_ids.shape[0], capacity=64) for r in ranges]
    position, new, tokens, logits = 0, input_ids, [], None
    for _ in range(steps):
        hidden = head.embed(new)
        for block_range, cache in zip(ranges, caches, strict=True):
            hidden = block_range(hidden, cache, position)
        position += new.shape[1]
        logits = head.logits(hidden)
        new = logits[:, -1:].argmax(-1)
        tokens.append(new)
    return torch.cat(tokens, dim=1), logits


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_chained_block_ranges_equal_local_model(family: str, tmp_path: Path) -> None:
    path = write_tiny_checkpoint(family, tmp_path / family)
    input_ids = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(0))
    tokens, last_logits = run_split(path, [(0, 3), (3, 5), (5, 8)], input_ids, steps=8)
    local = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = local.generate(input_ids, max_new_tokens=8, do_sample=False)
    assert tokens.tolist() == expected[:, 7:].tolist()
    with torch.no_grad():
        reference = local(expected[:, :-1]).logits[:, -1:]
    torch.testing.assert_close(last_logits, reference, rtol=1e-5, atol=1e-5)


def test_a_block_range_reads_only_its_own_tensors(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    requested: list[str] = []
    original = checkpoint_module.load_tensors

    def spy(path, wanted=None, *, prefixes=()):  # type: ignore[no-untyped-def]
        tensors = original(path, wanted, prefixes=prefixes)
        requested.extend(tensors)
        return tensors

    monkeypatch.setattr("swarm.model.blocks.load_tensors", spy)
    BlockRange(resolve_model(str(tiny_llama)), 2, 4)
    assert requested and all(name.startswith(("model.layers.2.", "model.layers.3.")) for name in requested)


def test_quantized_blocks_run_and_stay_close(tiny_llama: Path) -> None:
    input_ids = torch.randint(3, 128, (1, 6), generator=torch.Generator().manual_seed(1))
    _, exact = run_split(tiny_llama, [(0, 8)], input_ids, steps=1)
    for quant in ("int8", "nf4"):
        source = resolve_model(str(tiny_llama))
        block_range = BlockRange(source, 0, 8, quant=quant)
        assert block_range.block_bytes(0) < BlockRange(source, 0, 8).block_bytes(0)
        _, approximate = run_split(tiny_llama, [(0, 8)], input_ids, steps=1, quant=quant)
        assert torch.isfinite(approximate).all()
        cosine = torch.nn.functional.cosine_similarity(approximate.flatten(), exact.flatten(), dim=0)
        assert cosine > 0.9, (quant, cosine)


@pytest.mark.parametrize("quant", ["none", "int8", "nf4"])
def test_blocks_and_kv_in_pool_pages_compute_exactly_as_in_their_own_memory(tiny_llama: Path, quant: str) -> None:
    source = resolve_model(str(tiny_llama))
    pool = PagePool(16 << 20, 64 << 10)
    plain = BlockRange(source, 2, 6, quant=quant)
    pooled = BlockRange(source, 2, 6, quant=quant, adopt=lambda index, tensors: pool.adopt(ParamsOwner(index), tensors))
    kv_pages = pool.pages_needed(pooled.kv_cache_bytes(batch=2, capacity=16))
    buffers = {}
    for block in range(2, 6):
        pool.allocate(KVOwner("s", block), kv_pages)
        buffers[block] = pool.buffer(KVOwner("s", block))
    buffers[2].fill_(255)  # pool pages are not cleared for a new session: stale bytes must never be read
    plain_caches = plain.new_caches(2, 6, batch=2, capacity=16)
    pooled_caches = pooled.new_caches(2, 6, batch=2, capacity=16, buffers=buffers)
    generator = torch.Generator().manual_seed(2)
    position = 0
    for tokens in (5, 1, 1, 3):
        hidden = torch.randn(2, tokens, source.config.hidden_size, generator=generator)
        expected = plain(hidden, plain_caches, position)
        torch.testing.assert_close(pooled(hidden, pooled_caches, position), expected, rtol=0, atol=0)
        position += tokens
    pool_memory = range(pool.storage.data_ptr(), pool.storage.data_ptr() + pool.storage.numel())
    # Every weight still lives in its block's pages after forwards (bitsandbytes int8 swaps weights at its first).
    for index, block in zip(range(2, 6), pooled.blocks, strict=True):
        run = pool.buffer(ParamsOwner(index))
        pages = range(run.data_ptr(), run.data_ptr() + run.numel())
        assert all(tensor.data_ptr() in pages for tensor in block.parameters())
    assert all(cache.key.data_ptr() in pool_memory for cache in pooled_caches.values())
    assert pool.stats().pages_params == sum(pool.pages_needed(pooled.block_bytes(i)) for i in range(2, 6))
    pool.check_invariants()


@pytest.mark.parametrize("text", ["3-5", "5:3", "a:b", "1:2:3", "-1:4", "4:4", ""])
def test_unparseable_block_ranges(text: str) -> None:
    with pytest.raises(InvalidBlockRange):
        parse_block_range(text)


def test_block_range_past_the_model_is_rejected() -> None:
    assert parse_block_range("0:8", 8) == (0, 8)
    with pytest.raises(InvalidBlockRange, match="exceeds"):
        parse_block_range("4:9", 8)


def test_unsupported_architecture_names_the_supported_ones() -> None:
    from transformers import GPT2Config

    with pytest.raises(UnsupportedArchitecture, match=r"gpt2.*llama.*qwen2"):
        get_family(GPT2Config())
    assert get_family(tiny_config("qwen2")).name == "qwen2"


def test_sliding_window_masks_old_tokens() -> None:
    from swarm.model.kv import causal_mask

    mask = causal_mask(3, 5, sliding_window=4, device=torch.device("cpu"))
    assert mask is not None and mask.shape == (1, 1, 3, 8)
    assert mask[0, 0, 0].tolist() == [False, False, True, True, True, True, False, False]
    assert causal_mask(1, 5, sliding_window=None, device=torch.device("cpu")) is None
