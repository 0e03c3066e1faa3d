"""The rotary position tables of the server's blocks: cos and sin of each position, from the checkpoint's RoPE
parameters, computed as transformers' rotary embeddings compute them (their family's class is the reference the
tests compare against). Only `transformers.modeling_rope_utils` is imported: a server's start-up does not pay for
transformers' modelling modules."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from swarm.model.family import DecoderFamily

DYNAMIC_ROPE_TYPES = ("dynamic", "longrope")  # their frequencies change with the sequence's length: the family's
# transformers class computes those


def rope_frequencies(config: PretrainedConfig) -> tuple[torch.Tensor, float] | None:
    """Gives the inverse frequencies and the attention scaling of the config's RoPE, or None for a RoPE type whose
    frequencies change with the sequence (`DYNAMIC_ROPE_TYPES`)."""
    parameters = getattr(config, "rope_parameters", None) or {}
    rope_type = parameters.get("rope_type", "default")
    if rope_type in DYNAMIC_ROPE_TYPES:
        return None
    if rope_type != "default":
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config)
        return inv_freq.float(), float(scaling)
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 1.0 / (parameters["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0


class RotaryTable:
    """cos/sin of every position up to a length, computed once and grown on demand."""

    def __init__(self, config: PretrainedConfig, family: DecoderFamily, *, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.dtype, self.device = dtype, device
        self.frequencies = rope_frequencies(config)
        self.embedding = (family.rotary_embedding(config).to(device) if self.frequencies is None else None)
        self.cos = self.sin = torch.empty(0, device=device)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gives cos and sin ([rows, 1, head_dim]) of `positions`."""
        needed = int(positions.max()) + 1
        if needed > self.cos.shape[0]:
            self.cos, self.sin = self._table(max(256, 1 << (needed - 1).bit_length()))
        positions = positions.to(self.device)
        return self.cos[positions][:, None], self.sin[positions][:, None]

    def _table(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(length, device=self.device)
        if self.embedding is not None:
            cos, sin = self.embedding(torch.empty(0, dtype=self.dtype, device=self.device), positions[None])
            return cos[0], sin[0]
        assert self.frequencies is not None
        inv_freq, scaling = self.frequencies
        with torch.no_grad():
            freqs = positions[:, None].float() * inv_freq.to(self.device)[None]
            angles = torch.cat((freqs, freqs), dim=-1)
            return (angles.cos() * scaling).to(self.dtype), (angles.sin() * scaling).to(self.dtype)
