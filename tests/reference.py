"""What the server's blocks must equal: transformers' own decoder layers, and a local runner of our paged blocks."""

from __future__ import annotations

from collections.abc import Hashable, Mapping

import torch
from transformers import DynamicCache

from swarm.memory import KVOwner, PagePool, kv_pages_for
from swarm.model import BlockRange, ModelSource, get_family
from swarm.model.checkpoint import load_tensors
from swarm.model.paged_kv import PagedBatch, SequenceChunk


class ReferenceBlocks:
    """Blocks [start, end) as transformers' decoder layers with a DynamicCache, run one sequence batch at a time.

    The attention mask is written here from its definition (a query sees keys at or before it, and within the
    window of a sliding-window layer), independently of the server's masks."""

    def __init__(self, source: ModelSource, start: int, end: int) -> None:
        self.config = source.config
        self.config._attn_implementation = "sdpa"
        self.family = get_family(self.config)
        self.start, self.end = start, end
        tensors = load_tensors(source.path, prefixes=[self.family.block_prefix(i) for i in range(start, end)])
        self.layers = []
        for index in range(start, end):
            prefix = self.family.block_prefix(index)
            layer = self.family.decoder_layer(self.config, layer_idx=index)
            state = {name.removeprefix(prefix): tensor for name, tensor in tensors.items() if name.startswith(prefix)}
            layer.load_state_dict(state, strict=True)
            self.layers.append(layer.eval())
        self.rotary = self.family.rotary_embedding(self.config)
        self.cache = DynamicCache()
        self.position = 0

    @torch.inference_mode()
    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        """Gives the output for `hidden` ([batch, tokens, hidden]) after the history this reference has seen."""
        batch, tokens, _ = hidden.shape
        position_ids = torch.arange(self.position, self.position + tokens)[None].expand(batch, -1)
        embeddings = self.rotary(hidden, position_ids)
        queries = torch.arange(self.position, self.position + tokens)[:, None]
        keys = torch.arange(self.position + tokens)[None, :]
        for index, layer in zip(range(self.start, self.end), self.layers, strict=True):
            allowed = keys <= queries
            window = self.family.sliding_window(self.config, index)
            if window is not None:
                allowed = allowed & (queries - keys < window)
            hidden = layer(hidden, attention_mask=allowed[None, None], position_ids=position_ids,
                           past_key_values=self.cache, position_embeddings=embeddings)
        self.position += tokens
        return hidden


class PagedRunner:
    """Runs a BlockRange over a page pool of its own: sequences with page tables, as the server's sessions hold
    them, any number of them in one batch."""

    def __init__(self, blocks: BlockRange, *, page_bytes: int, pages: int) -> None:
        self.blocks = blocks
        self.pool = PagePool(pages * page_bytes, page_bytes)
        self.kv = blocks.paged_kv(self.pool.storage, page_bytes)
        self.tables: dict[Hashable, dict[int, list[int]]] = {}
        self.positions: dict[Hashable, int] = {}

    def step(self, inputs: Mapping[Hashable, torch.Tensor]) -> dict[Hashable, torch.Tensor]:
        """Gives each sequence's output for its new tokens (`inputs[sequence]`: [tokens, hidden]), all computed in
        one forward pass."""
        chunks, row = [], 0
        for sequence, hidden in inputs.items():
            position = self.positions.setdefault(sequence, 0)
            tables = self.tables.setdefault(sequence, {block: [] for block in range(self.blocks.start,
                                                                                    self.blocks.end)})
            needed = kv_pages_for(position + hidden.shape[0], self.kv.tokens_per_page)
            for block, pages in tables.items():
                if needed > len(pages):
                    pages.extend(self.pool.take(KVOwner(str(sequence), block), needed - len(pages)))
            chunks.append(SequenceChunk(row, hidden.shape[0], position, self.blocks.start, self.blocks.end, tables))
            row += hidden.shape[0]
        output = self.blocks(torch.cat(list(inputs.values())), PagedBatch(tuple(chunks)), self.kv)
        results = {}
        for (sequence, hidden), chunk in zip(inputs.items(), chunks, strict=True):
            results[sequence] = output[chunk.rows]
            self.positions[sequence] += hidden.shape[0]
        return results

    def close(self, sequence: Hashable) -> None:
        """Frees a sequence's pages."""
        self.pool.free_session(str(sequence))
        self.tables.pop(sequence, None)
        self.positions.pop(sequence, None)
