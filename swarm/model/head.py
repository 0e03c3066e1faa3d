"""The parts of a model a client keeps locally: token embeddings, final norm and LM head."""

from __future__ import annotations

import torch
from torch import nn

from swarm.model.checkpoint import load_tensors
from swarm.model.family import get_family
from swarm.model.source import ModelSource


class ClientHead(nn.Module):
    """Embeddings in, logits out; the transformer blocks in between live on the swarm."""

    def __init__(self, source: ModelSource, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"):
        super().__init__()
        family = get_family(source.config)
        config = source.config
        wanted = [family.embed_key, family.norm_key, family.lm_head_key]
        tensors = load_tensors(source.path, wanted)
        embed_weight = tensors[family.embed_key].to(dtype)
        self.embed_tokens = nn.Embedding.from_pretrained(embed_weight, freeze=True)
        self.norm = family.rms_norm(config.hidden_size, eps=config.rms_norm_eps)
        self.norm.load_state_dict({"weight": tensors[family.norm_key].to(dtype)})
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        tied = getattr(config, "tie_word_embeddings", False) or family.lm_head_key not in tensors
        self.lm_head.weight = self.embed_tokens.weight if tied else nn.Parameter(tensors[family.lm_head_key].to(dtype))
        self.to(device).eval().requires_grad_(False)

    @torch.inference_mode()
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Gives the input hidden states of `input_ids` ([batch, tokens] -> [batch, tokens, hidden])."""
        return self.embed_tokens(input_ids.to(self.embed_tokens.weight.device))

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Gives the next-token logits after the final norm and LM head."""
        hidden = hidden.to(self.lm_head.weight.device, self.lm_head.weight.dtype)
        return self.lm_head(self.norm(hidden))
