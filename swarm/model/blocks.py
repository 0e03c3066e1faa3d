"""A contiguous range of transformer blocks loaded from a checkpoint (only those blocks' weights) and run with KV."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn

from swarm.errors import InvalidBlockRange
from swarm.model.checkpoint import load_tensors
from swarm.model.device import dtype_name
from swarm.model.family import get_family
from swarm.model.kv import CacheView, KVCache, causal_mask
from swarm.model.quant import quantize_linears, realias_moved_weights
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
    """Blocks [start, end) of a model, on one device and dtype, optionally quantized with bitsandbytes."""

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
        """Loads blocks [start, end); `adopt(index, tensors)`, if given, takes each block's tensors as soon as it is
        built (the server moves them into its pool pages, so at most one block sits outside the pool at a time)."""
        super().__init__()
        parse_block_range(f"{start}:{end}", source.num_blocks)
        self.family = get_family(source.config)
        self.config = source.config
        self.config._attn_implementation = "sdpa"
        self.start, self.end = start, end
        self.dtype, self.device, self.quant = dtype, torch.device(device), quant
        prefixes = [self.family.block_prefix(index) for index in range(start, end)]
        tensors = load_tensors(source.path, prefixes=prefixes)
        blocks = []
        for index, prefix in zip(range(start, end), prefixes, strict=True):
            block = self.family.build_block(self.config, index)
            state = {name.removeprefix(prefix): tensor.to(dtype) for name, tensor in tensors.items()
                     if name.startswith(prefix)}
            block.load_state_dict(state, strict=True, assign=True)
            block = quantize_linears(block.eval(), quant, compute_dtype=dtype, device=self.device)
            if adopt is not None:
                adopt(index, [*block.parameters(), *block.buffers()])
                realias_moved_weights(block)
            blocks.append(block)
        self.blocks = nn.ModuleList(blocks)
        self.rotary = self.family.rotary_embedding(self.config).to(self.device)
        self.kv_heads, self.head_dim = self.family.kv_shape(self.config)

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def dtype_name(self) -> str:
        return dtype_name(self.dtype)

    def kv_bytes_per_token(self) -> int:
        """Gives the KV bytes one token of one sequence takes in one block."""
        return 2 * self.kv_heads * self.head_dim * torch.finfo(self.dtype).bits // 8

    def block_bytes(self, index: int) -> int:
        """Gives the bytes of block `index`'s parameters and buffers as they sit in memory (after quantization)."""
        block = self.blocks[index - self.start]
        return sum(t.numel() * t.element_size() for t in (*block.parameters(), *block.buffers()))

    def kv_cache_bytes(self, *, batch: int, capacity: int) -> int:
        """Gives the bytes one block's KV cache takes for `batch` sequences of up to `capacity` tokens."""
        return KVCache.nbytes_for(
            batch=batch, kv_heads=self.kv_heads, capacity=capacity, head_dim=self.head_dim, dtype=self.dtype
        )

    def new_caches(
        self, start: int, end: int, *, batch: int, capacity: int, buffers: Mapping[int, torch.Tensor] | None = None
    ) -> dict[int, KVCache]:
        """Gives KV caches for blocks [start, end): views into `buffers[block]` (pool pages) or fresh memory."""
        shape = {"batch": batch, "kv_heads": self.kv_heads, "capacity": capacity, "head_dim": self.head_dim}
        if buffers is None:
            return {index: KVCache.zeros(**shape, dtype=self.dtype, device=self.device) for index in range(start, end)}
        return {index: KVCache.in_buffer(buffers[index], **shape, dtype=self.dtype) for index in range(start, end)}

    @torch.inference_mode()
    def forward(self, hidden: torch.Tensor, caches: dict[int, KVCache], position: int) -> torch.Tensor:
        """Gives the hidden states after the blocks that `caches` holds, for tokens at [position, position + n)."""
        hidden = hidden.to(self.device, self.dtype)
        batch, new_tokens, _ = hidden.shape
        position_ids = torch.arange(position, position + new_tokens, device=self.device)[None].expand(batch, -1)
        position_embeddings = self.rotary(hidden, position_ids)
        view = CacheView(caches, position)
        masks: dict[int | None, torch.Tensor | None] = {}
        for index in sorted(caches):
            window = self.family.sliding_window(self.config, index)
            if window not in masks:
                masks[window] = causal_mask(new_tokens, position, sliding_window=window, device=self.device)
            hidden = self.blocks[index - self.start](
                hidden,
                attention_mask=masks[window],
                position_ids=position_ids,
                past_key_values=view,
                position_embeddings=position_embeddings,
            )
        return hidden
