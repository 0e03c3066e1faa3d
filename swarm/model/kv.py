"""Per-session attention caches, preallocated to the reserved length, and the view transformers writes into."""

from __future__ import annotations

import torch


class KVCache:
    """One session's keys and values for one block, [batch, kv_heads, capacity, head_dim] each, allocated up front."""

    def __init__(self, key: torch.Tensor, value: torch.Tensor) -> None:
        if key.shape != value.shape or key.dim() != 4:
            raise ValueError(f"key and value must have one 4-d shape, got {tuple(key.shape)} and {tuple(value.shape)}")
        self.key, self.value = key, value

    @staticmethod
    def nbytes_for(*, batch: int, kv_heads: int, capacity: int, head_dim: int, dtype: torch.dtype) -> int:
        """Gives the bytes a cache of this shape takes in a buffer, keys then values at an aligned offset."""
        return 2 * _aligned(batch * kv_heads * capacity * head_dim * torch.finfo(dtype).bits // 8)

    @classmethod
    def zeros(
        cls, *, batch: int, kv_heads: int, capacity: int, head_dim: int, dtype: torch.dtype, device: torch.device
    ) -> KVCache:
        """Gives a cache in fresh memory of its own."""
        shape = (batch, kv_heads, capacity, head_dim)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))

    @classmethod
    def in_buffer(
        cls, buffer: torch.Tensor, *, batch: int, kv_heads: int, capacity: int, head_dim: int, dtype: torch.dtype
    ) -> KVCache:
        """Gives a cache whose keys and values are views into `buffer` (uint8, e.g. pages of the server's pool).

        The memory is not cleared: attention only ever reads positions that a step has written.
        """
        needed = cls.nbytes_for(batch=batch, kv_heads=kv_heads, capacity=capacity, head_dim=head_dim, dtype=dtype)
        if buffer.dtype != torch.uint8 or buffer.numel() < needed:
            raise ValueError(f"a cache of {needed} bytes does not fit a {buffer.dtype} buffer of {buffer.numel()}")
        shape = (batch, kv_heads, capacity, head_dim)
        half = needed // 2
        key = buffer[: half].view(dtype)[: batch * kv_heads * capacity * head_dim].view(shape)
        value = buffer[half : needed].view(dtype)[: batch * kv_heads * capacity * head_dim].view(shape)
        return cls(key, value)

    @property
    def capacity(self) -> int:
        return self.key.shape[2]

    @property
    def nbytes(self) -> int:
        return self.key.nbytes + self.value.nbytes


def _aligned(nbytes: int, alignment: int = 64) -> int:
    return -(-nbytes // alignment) * alignment


class CacheView:
    """The `past_key_values` a transformers attention layer sees: writes new keys at `position`, returns the prefix.

    Nothing here advances a length: the session commits its position only after every block succeeded, so a step
    that fails halfway leaves the visible history unchanged.
    """

    def __init__(self, caches: dict[int, KVCache], position: int) -> None:
        self.caches = caches
        self.position = position

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cache = self.caches[layer_idx]
        end = self.position + key_states.shape[2]
        cache.key[:, :, self.position : end] = key_states
        cache.value[:, :, self.position : end] = value_states
        return cache.key[:, :, :end], cache.value[:, :, :end]


def causal_mask(
    new_tokens: int, position: int, *, sliding_window: int | None, device: torch.device
) -> torch.Tensor | None:
    """Gives the boolean attention mask for `new_tokens` queries after `position` cached tokens, or None if SDPA's
    own causal flag is exact (a single query, or a prompt starting at 0 without an active window)."""
    total = position + new_tokens
    window_active = sliding_window is not None and total > sliding_window
    if not window_active and (new_tokens == 1 or position == 0):
        return None
    query_pos = torch.arange(position, total, device=device)[:, None]
    key_pos = torch.arange(total, device=device)[None, :]
    allowed = key_pos <= query_pos
    if window_active:
        allowed &= key_pos > query_pos - sliding_window
    return allowed[None, None]
