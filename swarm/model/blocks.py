"""Transformer blocks loaded from a checkpoint (only those blocks' weights), one at a time, run as one batch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
from torch import nn

from swarm.errors import InvalidBlockRange
from swarm.memory import kv_bytes_per_token
from swarm.model.checkpoint import load_tensors
from swarm.model.decoder import AttentionShape, DecoderBlock
from swarm.model.device import dtype_name
from swarm.model.family import get_family
from swarm.model.paged_kv import PagedBatch, PagedKV
from swarm.model.quant import quantize_linears, realias_moved_weights
from swarm.model.rotary import RotaryTable
from swarm.model.source import ModelSource


def parse_block_range(text: str, num_blocks: int | None = None) -> tuple[int, int]:
    """Gives (start, end) from "a:b" (0-based, end exclusive), checked against `num_blocks` when known."""
    parts = text.strip().split(":")
    try:
        if len(parts) != 2:
            raise ValueError
        start, end = int(parts[0]), int(parts[1])
    except ValueError:
        raise InvalidBlockRange(f"cannot parse block range {text!r}: expected START:END, e.g. 0:10") from None
    if not 0 <= start < end:
        raise InvalidBlockRange(f"block range {text!r} is empty or negative: need 0 <= START < END")
    if num_blocks is not None and end > num_blocks:
        raise InvalidBlockRange(f"block range {text!r} exceeds the model's {num_blocks} blocks")
    return start, end


class BlockRange(nn.Module):
    """Blocks of a model on one device and dtype, optionally quantized with bitsandbytes: [start, end) when built, then
    loaded and unloaded one block at a time while the server runs (`load_block`, `unload_block`).

    The loaded blocks need not be contiguous while a server moves its range (it loads the new blocks before the old
    ones are unloaded); every sequence a forward pass computes passes through loaded blocks only.
    """

    def __init__(
        self,
        source: ModelSource,
        start: int,
        end: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        quant: str = "none",
        adopt: Callable[[int, list[torch.Tensor]], object] | None = None,
    ) -> None:
        """Loads blocks [start, end) (none if start == end); `adopt(index, tensors)`, if given, takes each block's
        tensors as soon as it is built (the server moves them into its pool pages, so at most one block sits outside
        the pool at a time)."""
        super().__init__()
        if start != end:
            parse_block_range(f"{start}:{end}", source.num_blocks)
        self.source = source
        self.family = get_family(source.config)
        self.config = source.config
        self.num_blocks = source.num_blocks
        self.dtype, self.device, self.quant = dtype, torch.device(device), quant
        self.adopt = adopt
        self._loaded: dict[int, nn.Module] = {}
        prefixes = [self.family.block_prefix(index) for index in range(start, end)]
        tensors = load_tensors(source.path, prefixes=prefixes)
        for index, prefix in zip(range(start, end), prefixes, strict=True):
            self._build(index, {name: tensor for name, tensor in tensors.items() if name.startswith(prefix)})
        self.kv_heads, self.head_dim = self.family.kv_shape(self.config)
        self.rotary = RotaryTable(self.config, self.family, dtype=dtype, device=self.device)

    def _build(self, index: int, tensors: dict[str, torch.Tensor]) -> None:
        prefix = self.family.block_prefix(index)
        state = {name.removeprefix(prefix): tensor.to(self.dtype) for name, tensor in tensors.items()}
        window = self.family.sliding_window(self.config, index)
        block = DecoderBlock.from_config(self.config, state, sliding_window=window)
        block = quantize_linears(block.eval(), self.quant, compute_dtype=self.dtype, device=self.device)
        if self.adopt is not None:
            self.adopt(index, [*block.parameters(), *block.buffers()])
            realias_moved_weights(block)
        self._loaded[index] = block  # published last: a compute thread sees a block only once it is whole

    def load_block(self, index: int) -> None:
        """Reads block `index` from the checkpoint and builds it (through `adopt`, into the pool's pages); raises
        what `adopt` raises (OutOfPages) and then holds nothing of it."""
        if not 0 <= index < self.num_blocks:
            raise InvalidBlockRange(f"block {index} is outside the model's {self.num_blocks} blocks")
        if index in self._loaded:
            raise ValueError(f"block {index} is already loaded")
        prefix = self.family.block_prefix(index)
        self._build(index, load_tensors(self.source.path, prefixes=[prefix]))

    def unload_block(self, index: int) -> None:
        """Forgets block `index`; the caller returns its pages to the pool once no batch can compute through it."""
        if self._loaded.pop(index, None) is None:
            raise ValueError(f"block {index} is not loaded")

    def block(self, index: int) -> nn.Module:
        """Gives loaded block `index` (KeyError if it is not loaded)."""
        return self._loaded[index]

    @property
    def loaded(self) -> list[int]:
        """Gives the indices of the loaded blocks, in order."""
        return sorted(self._loaded)

    @property
    def start(self) -> int:
        """Gives the first loaded block (0 when none is)."""
        return min(self._loaded, default=0)

    @property
    def end(self) -> int:
        """Gives one past the last loaded block (0 when none is)."""
        return max(self._loaded, default=-1) + 1

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def dtype_name(self) -> str:
        return dtype_name(self.dtype)

    def kv_bytes_per_token(self) -> int:
        """Gives the KV bytes one token of one sequence takes in one block."""
        return kv_bytes_per_token(kv_heads=self.kv_heads, head_dim=self.head_dim, dtype=self.dtype)

    def attention_shape(self, index: int) -> AttentionShape:
        """Gives what attention in block `index` needs besides its KV, whether the block is loaded or not."""
        heads = int(self.config.num_attention_heads)
        return AttentionShape(heads, self.kv_heads, self.head_dim, self.family.sliding_window(self.config, index))

    def block_bytes(self, index: int) -> int:
        """Gives the bytes of block `index`'s parameters and buffers as they sit in memory (after quantization)."""
        block = self._loaded[index]
        return sum(t.numel() * t.element_size() for t in (*block.parameters(), *block.buffers()))

    def paged_kv(self, storage: torch.Tensor, page_bytes: int) -> PagedKV:
        """Gives the KV page view of a pool's `storage` for these blocks' shape and dtype."""
        return PagedKV(storage, page_bytes, kv_heads=self.kv_heads, head_dim=self.head_dim, dtype=self.dtype)

    @torch.inference_mode()
    def forward(self, hidden: torch.Tensor, batch: PagedBatch, kv: PagedKV) -> torch.Tensor:
        """Gives the hidden states ([rows, hidden]) after each chunk's blocks, for `hidden` ([rows, hidden]) of
        `batch`; every chunk's keys and values are written into its pages."""
        forward_pass = ForwardPass(self, kv, hidden, batch)
        forward_pass.run_to(forward_pass.end_block)
        return forward_pass.hidden


class ForwardPass:
    """A forward pass through a BlockRange in progress, one block at a time. Chunks may join it between two blocks:
    they first run alone through the blocks it has passed, then go on in it (continuous batching, per block)."""

    def __init__(self, blocks: BlockRange, kv: PagedKV, hidden: torch.Tensor, batch: PagedBatch) -> None:
        self.blocks, self.kv = blocks, kv
        self.hidden = hidden.to(blocks.device, blocks.dtype)
        self.batch = batch
        self.cos, self.sin = blocks.rotary.lookup(batch.positions())
        self.first_block = self.next_block = min(chunk.block_start for chunk in batch.chunks)
        self.end_block = max(chunk.block_end for chunk in batch.chunks)

    @property
    def done(self) -> bool:
        return self.next_block >= self.end_block

    @torch.inference_mode()
    def advance(self) -> None:
        """Computes the next block for the chunks that pass through it."""
        index, batch = self.next_block, self.batch
        block = self.blocks.block(index)
        through = batch.through(index)
        if through is batch:
            self.hidden = block(self.hidden, batch, self.kv, index, self.cos, self.sin)
        elif through.chunks:
            rows = batch.row_index(index).to(self.blocks.device)
            part = block(self.hidden[rows], through, self.kv, index, self.cos[rows], self.sin[rows])
            self.hidden = self.hidden.index_copy(0, rows, part)
        self.next_block += 1

    def run_to(self, block: int) -> None:
        """Computes blocks until the next one is `block` (or the pass is done)."""
        while self.next_block < min(block, self.end_block):
            self.advance()

    def join(self, hidden: torch.Tensor, batch: PagedBatch) -> None:
        """Adds `batch`'s chunks (rows `hidden`) to this pass, their rows after its own."""
        joining = ForwardPass(self.blocks, self.kv, hidden, batch)
        joining.run_to(self.next_block)  # catch up through the blocks this pass has computed
        offset = self.hidden.shape[0]
        renumbered = tuple(replace(chunk, row=chunk.row + offset) for chunk in batch.chunks)
        self.batch = PagedBatch(self.batch.chunks + renumbered)
        self.hidden = torch.cat([self.hidden, joining.hidden])
        self.cos, self.sin = torch.cat([self.cos, joining.cos]), torch.cat([self.sin, joining.sin])
        self.end_block = max(self.end_block, joining.end_block)
