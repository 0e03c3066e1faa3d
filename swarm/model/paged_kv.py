"""Keys and values in pages of the server's pool, and the batch of sequences one forward pass computes.

A KV page holds `tokens_per_page` consecutive tokens of ONE sequence (one row of a session) in ONE block, keys then
values: `[2, kv_heads, tokens_per_page, head_dim]`. A sequence's history in a block is the list of its pages in
token order (its page table), so nothing needs a contiguous run and a session takes pages only as it grows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from swarm.memory import kv_bytes_per_token, kv_tokens_per_page


class PagedKV:
    """Every page of a pool's buffer seen as a KV page: a `[pages, 2, kv_heads, tokens_per_page, head_dim]` view.

    The view aliases the whole buffer, parameter pages included; only pages a sequence's page table names are ever
    read or written through it.
    """

    def __init__(
        self, storage: torch.Tensor, page_bytes: int, *, kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> None:
        element_bytes = torch.finfo(dtype).bits // 8
        bytes_per_token = kv_bytes_per_token(kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
        self.tokens_per_page = kv_tokens_per_page(page_bytes, bytes_per_token)
        if self.tokens_per_page < 1:
            raise ValueError(
                f"a page of {page_bytes} bytes cannot hold one token's KV for one block ({bytes_per_token} bytes); "
                f"use a larger page size"
            )
        if page_bytes % element_bytes:
            raise ValueError(f"the page size {page_bytes} is not a multiple of {element_bytes} ({dtype})")
        if storage.dtype != torch.uint8 or storage.numel() % page_bytes:
            raise ValueError(f"storage must be pages of {page_bytes} bytes, got {storage.dtype}[{storage.numel()}]")
        pages_total = storage.numel() // page_bytes
        used_bytes = self.tokens_per_page * bytes_per_token
        by_page = storage.view(pages_total, page_bytes)[:, :used_bytes]
        self.pages = by_page.view(dtype).view(pages_total, 2, kv_heads, self.tokens_per_page, head_dim)
        self.kv_heads, self.head_dim, self.dtype = kv_heads, head_dim, dtype

    def write(self, pages: Sequence[int], position: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Stores `keys`/`values` ([tokens, kv_heads, head_dim]) of tokens [position, position + tokens)."""
        tokens_per_page, done, count = self.tokens_per_page, 0, keys.shape[0]
        while done < count:
            page, offset = divmod(position + done, tokens_per_page)
            take = min(count - done, tokens_per_page - offset)
            target = self.pages[pages[page], :, :, offset : offset + take]
            target[0].copy_(keys[done : done + take].transpose(0, 1))
            target[1].copy_(values[done : done + take].transpose(0, 1))
            done += take

    def read(self, pages: Sequence[int], start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Gives keys and values ([kv_heads, end - start, head_dim]) of tokens [start, end): views of one page when
        they lie in one, else a copy gathered from each."""
        tokens_per_page = self.tokens_per_page
        first, last = start // tokens_per_page, (end - 1) // tokens_per_page
        if first == last:
            offset = first * tokens_per_page
            page = self.pages[pages[first], :, :, start - offset : end - offset]
            return page[0], page[1]
        parts = []
        for index in range(first, last + 1):
            low = max(start - index * tokens_per_page, 0)
            high = min(end - index * tokens_per_page, tokens_per_page)
            parts.append(self.pages[pages[index], :, :, low:high])
        both = torch.cat(parts, dim=2)
        return both[0], both[1]


@dataclass(frozen=True)
class SequenceChunk:
    """One sequence's tokens in a batch: its rows of the batch's hidden states, its history and its KV pages."""

    row: int  # first row of these tokens in the batch's [rows, hidden] matrix
    tokens: int
    position: int  # tokens of history before these
    block_start: int  # the blocks this sequence passes through: [block_start, block_end)
    block_end: int
    pages: Mapping[int, Sequence[int]]  # block -> page ids in token order, covering position + tokens

    @property
    def rows(self) -> slice:
        return slice(self.row, self.row + self.tokens)


@dataclass(frozen=True)
class DecodeGroup:
    """The decode steps of a batch whose whole history lies in their first page: their attention runs as one
    padded batch, since gathering their short histories costs less than one attention call per sequence."""

    chunks: tuple[SequenceChunk, ...]
    rows: torch.Tensor  # their rows in the batch (int64, [sequences])
    offsets: torch.Tensor  # where each new token goes in its page
    length: int  # the longest history, new token included
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)  # sliding window -> [sequences, 1, 1, length]

    def mask(self, window: int | None) -> torch.Tensor:
        """Gives which keys each sequence's query sees: its own history (within `window`), not the padding."""
        if window not in self.masks:
            keys = torch.arange(self.length)[None, :]
            positions = self.offsets[:, None]
            allowed = keys <= positions
            if window is not None:
                allowed &= keys > positions - window
            self.masks[window] = allowed[:, None, None, :]
        return self.masks[window]


MAX_GROUPED_KEYS = 2048  # sequences x longest history above which decode attention runs sequence by sequence


@dataclass(frozen=True)
class PagedBatch:
    """Every sequence chunk of one forward pass, their rows in order and contiguous."""

    chunks: tuple[SequenceChunk, ...]

    def decode_group(self, tokens_per_page: int) -> DecodeGroup | None:
        """Gives the decode steps whose attention can run as one padded batch (None if fewer than two)."""
        cached = self.__dict__.get("_decode_group", False)
        if cached is not False:
            return cached
        chunks = tuple(chunk for chunk in self.chunks if chunk.tokens == 1 and chunk.position < tokens_per_page)
        length = max((chunk.position + 1 for chunk in chunks), default=0)
        group = None
        if len(chunks) >= 2 and len(chunks) * length <= MAX_GROUPED_KEYS:
            group = DecodeGroup(chunks, torch.tensor([chunk.row for chunk in chunks]),
                                torch.tensor([chunk.position for chunk in chunks]), length)
        self.__dict__["_decode_group"] = group  # computed once, used by every block of the pass
        return group

    @property
    def rows(self) -> int:
        return sum(chunk.tokens for chunk in self.chunks)

    def positions(self) -> torch.Tensor:
        """Gives the position of every row (int64, [rows])."""
        return torch.cat([torch.arange(c.position, c.position + c.tokens) for c in self.chunks])

    def through(self, block: int) -> PagedBatch:
        """Gives the chunks that pass through `block`, with rows renumbered from 0 (the same batch if all do)."""
        chunks = [chunk for chunk in self.chunks if chunk.block_start <= block < chunk.block_end]
        if len(chunks) == len(self.chunks):
            return self
        renumbered, row = [], 0
        for chunk in chunks:
            renumbered.append(SequenceChunk(row, chunk.tokens, chunk.position, chunk.block_start, chunk.block_end,
                                            chunk.pages))
            row += chunk.tokens
        return PagedBatch(tuple(renumbered))

    def row_index(self, block: int) -> torch.Tensor:
        """Gives the rows (of this batch) of the chunks that pass through `block`."""
        return torch.cat([torch.arange(c.row, c.row + c.tokens) for c in self.chunks
                          if c.block_start <= block < c.block_end])
