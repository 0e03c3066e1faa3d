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
from swarm.model.decoder import chunk_mask
from swarm.model.paged_kv import PagedBatch, SequenceChunk
from swarm.model.rotary import RotaryTable
from tests.reference import PagedRunner, ReferenceBlocks
from tests.tiny_models import tiny_config, write_tiny_checkpoint

ROPES = {  # RoPE parameters beside rope_theta; "dynamic" is the case the family's transformers class computes
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
}


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("rope", sorted(ROPES))
def test_the_servers_rotary_table_equals_the_familys_transformers_embedding(family: str, rope: str) -> None:
    extra = ROPES[rope]
    config = tiny_config(family, **({"rope_parameters": {"rope_theta": 500.0, **extra}} if extra else {}))
    table = RotaryTable(config, get_family(config), dtype=torch.float32, device=torch.device("cpu"))
    positions = torch.tensor([0, 1, 5, 63, 64, 300])
    cos, sin = table.lookup(positions)
    reference_cos, reference_sin = get_family(config).rotary_embedding(config)(torch.empty(0), torch.arange(512)[None])
    assert torch.equal(cos[:, 0], reference_cos[0][positions]) and torch.equal(sin[:, 0], reference_sin[0][positions])


def run_split(path: Path, splits: list[tuple[int, int]], input_ids: torch.Tensor, steps: int, **block_kwargs):
    """Gives greedy tokens and last logits of the model run as chained block ranges over paged KV, each row of
    `input_ids` a sequence of its own in the same batches."""
    source = resolve_model(str(path))
    head = ClientHead(source)
    runners = [PagedRunner(BlockRange(source, start, end, **block_kwargs), page_bytes=4096, pages=256)
               for start, end in splits]
    new, tokens, logits = input_ids, [], None
    for _ in range(steps):
        hidden = {row: head.embed(new[row]) for row in range(new.shape[0])}
        for runner in runners:
            hidden = runner.step(hidden)
        logits = torch.stack([head.logits(hidden[row]) for row in range(new.shape[0])])
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


WINDOWED = {
    "llama": {},
    "mistral": {"sliding_window": 6},
    "qwen2": {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 4,
              "layer_types": ["full_attention"] * 4 + ["sliding_attention"] * 4},
}


@pytest.mark.parametrize("family", sorted(WINDOWED))
def test_block_outputs_equal_transformers_layers_in_mixed_batches(family: str, tmp_path: Path) -> None:
    """Sequences at different positions share batches: prefills cut into chunks, decode steps, a late joiner, on
    pages of 4 tokens (every history spans several pages) and sliding windows shorter than the histories."""
    path = write_tiny_checkpoint(family, tmp_path / family, **WINDOWED[family])
    source = resolve_model(str(path))
    blocks = BlockRange(source, 1, 7)
    runner = PagedRunner(blocks, page_bytes=4 * blocks.kv_bytes_per_token(), pages=4 * 6 * 8)
    references = {name: ReferenceBlocks(source, 1, 7) for name in "abcd"}
    generator = torch.Generator().manual_seed(3)
    schedule = [  # sequence -> new tokens, one batch per line
        {"a": 9, "b": 4},
        {"a": 1, "b": 5, "c": 2},
        {"a": 1, "b": 1, "c": 1},
        {"a": 1, "c": 7, "d": 11},
        {"a": 3, "b": 1, "c": 1, "d": 1},
        {"a": 1, "b": 1, "c": 1, "d": 1},
    ]
    for batch in schedule:
        inputs = {name: torch.randn(tokens, 64, generator=generator) for name, tokens in batch.items()}
        outputs = runner.step(inputs)
        for name, hidden in inputs.items():
            expected = references[name](hidden[None])[0]
            torch.testing.assert_close(outputs[name], expected, rtol=1e-5, atol=1e-5)
    assert max(len(pages) for pages in runner.tables["d"].values()) == 4  # 13 tokens on pages of 4
    for name in "abcd":
        runner.close(name)
    assert runner.pool.stats().pages_kv == 0
    runner.pool.check_invariants()


def test_sequences_that_pass_through_part_of_the_range_leave_the_others_exact(tiny_llama: Path) -> None:
    source = resolve_model(str(tiny_llama))
    blocks = BlockRange(source, 0, 8)
    pool = PagePool(64 * 4096, 4096)
    kv = blocks.paged_kv(pool.storage, pool.page_bytes)
    spans = {"whole": (0, 8), "head": (0, 3), "middle": (2, 6), "tail": (5, 8)}
    references = {name: ReferenceBlocks(source, *span) for name, span in spans.items()}
    tables = {name: {block: list(pool.take(KVOwner(name, block), 1)) for block in range(*span)}
              for name, span in spans.items()}
    generator = torch.Generator().manual_seed(4)
    inputs = {name: torch.randn(3, 64, generator=generator) for name in spans}
    chunks, row = [], 0
    for name, (start, end) in spans.items():
        chunks.append(SequenceChunk(row, 3, 0, start, end, tables[name]))
        row += 3
    output = blocks(torch.cat(list(inputs.values())), PagedBatch(tuple(chunks)), kv)
    for name, chunk in zip(spans, chunks, strict=True):
        expected = references[name](inputs[name][None])[0]
        torch.testing.assert_close(output[chunk.rows], expected, rtol=1e-5, atol=1e-5)


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
def test_blocks_in_pool_pages_compute_exactly_as_in_their_own_memory(tiny_llama: Path, quant: str) -> None:
    source = resolve_model(str(tiny_llama))
    pool = PagePool(16 << 20, 64 << 10)
    plain = PagedRunner(BlockRange(source, 2, 6, quant=quant), page_bytes=4096, pages=64)
    pooled_blocks = BlockRange(
        source, 2, 6, quant=quant, adopt=lambda index, tensors: pool.adopt(ParamsOwner(index), tensors)
    )
    pooled = PagedRunner(pooled_blocks, page_bytes=4096, pages=64)
    pooled.pool.storage.fill_(255)  # pool pages are not cleared for a new session: stale bytes must never be read
    generator = torch.Generator().manual_seed(2)
    for tokens in (5, 1, 1, 3):
        inputs = {row: torch.randn(tokens, source.config.hidden_size, generator=generator) for row in range(2)}
        expected = plain.step(inputs)
        for row, output in pooled.step(inputs).items():
            torch.testing.assert_close(output, expected[row], rtol=0, atol=0)
    # Every weight still lives in its block's pages after forwards (bitsandbytes int8 swaps weights at its first).
    for index in range(2, 6):
        block, run = pooled_blocks.block(index), pool.buffer(ParamsOwner(index))
        pages = range(run.data_ptr(), run.data_ptr() + run.numel())
        assert all(tensor.data_ptr() in pages for tensor in block.parameters())
    assert pool.stats().pages_params == sum(pool.pages_needed(pooled_blocks.block_bytes(i)) for i in range(2, 6))
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
    mask = chunk_mask(3, 5, 4, device=torch.device("cpu"))
    assert mask is not None and mask.shape == (1, 1, 3, 8)
    assert mask[0, 0, 0].tolist() == [False, False, True, True, True, True, False, False]
    assert chunk_mask(4, 0, None, device=torch.device("cpu")) is None  # SDPA's causal flag is exact
    assert chunk_mask(4, 0, 8, device=torch.device("cpu")) is None
    assert chunk_mask(2, 3, None, device=torch.device("cpu")) is not None  # a later chunk also sees the history


def test_a_page_too_small_for_one_token_is_refused(tiny_llama: Path) -> None:
    blocks = BlockRange(resolve_model(str(tiny_llama)), 0, 1)
    pool = PagePool(8 * 128, 128)
    with pytest.raises(ValueError, match="cannot hold one token"):
        blocks.paged_kv(pool.storage, pool.page_bytes)
    assert blocks.paged_kv(PagePool(8 * 256, 256).storage, 256).tokens_per_page == 1
