"""The server's own transformer block: one for the Llama family, with Mistral's and Qwen2's differences as data.

One forward pass serves a batch of sequences at different positions. The linear layers run once over all of the
batch's rows (QKV fused into one matrix multiply, gate and up into another); attention runs per sequence over its
own history, read from its KV pages. transformers' decoder layers are the reference it is tested against.

Attention needs the block's keys and values but none of its weights, and every other part of the block needs its
weights but no KV: `project` and `finish` are the block without attention, and `attend_chunk` is attention alone, so
a server whose block's KV is still on a peer can have the peer attend (KunServe's remote attention,
`server.remote_attention`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from swarm.errors import UnsupportedArchitecture
from swarm.model.paged_kv import DecodeGroup, PagedBatch, PagedKV, SequenceChunk


def activation_of(name: str) -> nn.Module:
    """Gives the MLP's activation named by a config's `hidden_act`: SiLU (every supported family's) without importing
    transformers' activations, which a server's start-up need not pay for; any other from them."""
    if name in ("silu", "swish"):
        return nn.SiLU()
    from transformers.activations import ACT2FN

    return ACT2FN[name]


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, as Llama's."""

    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        dtype = hidden.dtype
        hidden = hidden.to(torch.float32)
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * hidden.to(dtype)


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    layer.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(bias, requires_grad=False)
    return layer


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Gives x with rotary position embedding applied (Llama's half-split layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


@dataclass(frozen=True)
class AttentionShape:
    """What attention in one block needs besides the KV: its heads and its sliding window (no weights)."""

    heads: int
    kv_heads: int
    head_dim: int
    window: int | None = None


def attend_chunk(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, chunk: SequenceChunk, kv: PagedKV, block: int,
    shape: AttentionShape,
) -> torch.Tensor:
    """Writes one sequence's new keys and values ([tokens, kv_heads, head_dim]) into its pages for `block` and gives
    its attention output ([tokens, heads * head_dim]) for `queries` ([tokens, heads, head_dim], rotated) over its
    history, read page by page."""
    position, tokens, window = chunk.position, chunk.tokens, shape.window
    pages = chunk.pages[block]
    kv.write(pages, position, keys, values)
    end = position + tokens
    if tokens == 1:
        start = max(0, end - window) if window is not None else 0
        past_keys, past_values = kv.read(pages, start, end)
        # One query per head: the heads sharing a KV head become that head's queries, so no KV is repeated.
        query = queries.view(shape.kv_heads, shape.heads // shape.kv_heads, shape.head_dim)
        output = F.scaled_dot_product_attention(query[None], past_keys[None], past_values[None])
        return output.view(1, -1)
    past_keys, past_values = kv.read(pages, 0, end)
    mask = chunk_mask(tokens, position, window, device=queries.device)
    output = F.scaled_dot_product_attention(
        queries.transpose(0, 1)[None], past_keys[None], past_values[None], attn_mask=mask,
        is_causal=mask is None, enable_gqa=True,
    )
    return output[0].transpose(0, 1).reshape(tokens, -1)


class DecoderBlock(nn.Module):
    """A pre-norm decoder block: fused QKV attention over paged KV, then a gated MLP with fused gate and up."""

    def __init__(
        self,
        *,
        state: Mapping[str, torch.Tensor],
        heads: int,
        kv_heads: int,
        head_dim: int,
        rms_eps: float,
        activation: str,
        sliding_window: int | None,
    ) -> None:
        """Builds the block from its checkpoint tensors (names relative to the block, as transformers saves them);
        biases are used where the checkpoint has them (Qwen2's QKV, Llama's `attention_bias`)."""
        super().__init__()
        state = dict(state)

        def take(name: str) -> torch.Tensor:
            if name not in state:
                raise UnsupportedArchitecture(f"checkpoint block lacks {name!r}")
            return state.pop(name)

        def take_bias(name: str) -> torch.Tensor | None:
            return state.pop(name, None)

        attn, mlp = "self_attn.", "mlp."
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.sliding_window = sliding_window
        self.shape = AttentionShape(heads, kv_heads, head_dim, sliding_window)
        self.input_norm = RMSNorm(take("input_layernorm.weight"), rms_eps)
        q_bias, k_bias, v_bias = (take_bias(f"{attn}{name}_proj.bias") for name in "qkv")
        qkv_bias = None
        if q_bias is not None or k_bias is not None or v_bias is not None:
            parts = [(b if b is not None else torch.zeros(w.shape[0], dtype=w.dtype)) for b, w in
                     ((q_bias, state[f"{attn}q_proj.weight"]), (k_bias, state[f"{attn}k_proj.weight"]),
                      (v_bias, state[f"{attn}v_proj.weight"]))]
            qkv_bias = torch.cat(parts)
        qkv_weight = torch.cat([take(f"{attn}{name}_proj.weight") for name in "qkv"])
        self.qkv = _linear(qkv_weight, qkv_bias)
        self.o_proj = _linear(take(f"{attn}o_proj.weight"), take_bias(f"{attn}o_proj.bias"))
        self.post_norm = RMSNorm(take("post_attention_layernorm.weight"), rms_eps)
        gate_bias, up_bias = take_bias(f"{mlp}gate_proj.bias"), take_bias(f"{mlp}up_proj.bias")
        gate_up_bias = torch.cat([gate_bias, up_bias]) if gate_bias is not None and up_bias is not None else None
        self.gate_up = _linear(torch.cat([take(f"{mlp}gate_proj.weight"), take(f"{mlp}up_proj.weight")]), gate_up_bias)
        self.down = _linear(take(f"{mlp}down_proj.weight"), take_bias(f"{mlp}down_proj.bias"))
        self.act = activation_of(activation)
        if state:
            raise UnsupportedArchitecture(f"checkpoint block has tensors this block does not use: {sorted(state)}")
        if qkv_weight.shape[0] != (heads + 2 * kv_heads) * head_dim:
            raise UnsupportedArchitecture(f"QKV weights of shape {tuple(qkv_weight.shape)} do not match {heads} heads, "
                                          f"{kv_heads} KV heads of {head_dim}")

    @classmethod
    def from_config(
        cls, config: PretrainedConfig, state: Mapping[str, torch.Tensor], *, sliding_window: int | None
    ) -> DecoderBlock:
        """Gives block built from `state` with the shape and activation `config` names."""
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(
            state=state, heads=config.num_attention_heads, kv_heads=config.num_key_value_heads, head_dim=head_dim,
            rms_eps=config.rms_norm_eps, activation=config.hidden_act, sliding_window=sliding_window,
        )

    def forward(
        self, hidden: torch.Tensor, batch: PagedBatch, kv: PagedKV, block: int, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """Gives the block's output for `hidden` ([rows, hidden]) of `batch`, writing the rows' keys and values
        into the sequences' pages for `block`; cos/sin are the rows' rotary tables ([rows, 1, head_dim])."""
        queries, keys, values = self.project(hidden, cos, sin)
        return self.finish(hidden, self._attend(queries, keys, values, batch, kv, block))

    def project(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gives the rows' rotated queries ([rows, heads, head_dim]), rotated keys and values ([rows, kv_heads,
        head_dim]): the block up to attention."""
        rows = hidden.shape[0]
        heads, kv_heads, head_dim = self.heads, self.kv_heads, self.head_dim
        qkv = self.qkv(self.input_norm(hidden))
        qk = rotate(qkv[:, : (heads + kv_heads) * head_dim].view(rows, heads + kv_heads, head_dim), cos, sin)
        values = qkv[:, (heads + kv_heads) * head_dim :].view(rows, kv_heads, head_dim)
        return qk[:, :heads], qk[:, heads:], values

    def finish(self, hidden: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """Gives the block's output from its input rows and their attention output ([rows, heads * head_dim])."""
        hidden = hidden + self.o_proj(attended)
        gate, up = self.gate_up(self.post_norm(hidden)).chunk(2, dim=-1)
        return hidden + self.down(self.act(gate) * up)

    def _attend(
        self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, batch: PagedBatch, kv: PagedKV,
        block: int,
    ) -> torch.Tensor:
        """Gives each row's attention output ([rows, heads * head_dim]): every sequence attends over its own pages."""
        output = queries.new_empty(queries.shape[0], self.heads * self.head_dim)
        group = batch.decode_group(kv.tokens_per_page)
        if group is not None:
            output[group.rows] = self._attend_decodes(queries, keys, values, group, kv, block)
        for chunk in batch.chunks:
            if group is not None and chunk.tokens == 1 and chunk.position < kv.tokens_per_page:
                continue  # in the group
            output[chunk.rows] = attend_chunk(queries[chunk.rows], keys[chunk.rows], values[chunk.rows], chunk, kv,
                                              block, self.shape)
        return output

    def _attend_decodes(
        self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, group: DecodeGroup, kv: PagedKV,
        block: int,
    ) -> torch.Tensor:
        """Gives the attention output of a group of decode steps, one padded attention call for all of them."""
        device = queries.device
        first_pages = torch.tensor([chunk.pages[block][0] for chunk in group.chunks], device=device)
        rows, offsets = group.rows.to(device), group.offsets.to(device)
        kv.pages[first_pages, 0, :, offsets] = keys[rows]
        kv.pages[first_pages, 1, :, offsets] = values[rows]
        history = kv.pages[first_pages, :, :, : group.length]  # [sequences, 2, kv_heads, length, head_dim]
        query = queries[rows].view(len(group.chunks), self.kv_heads, self.heads // self.kv_heads, self.head_dim)
        mask = group.mask(self.sliding_window).to(device)
        output = F.scaled_dot_product_attention(query, history[:, 0], history[:, 1], attn_mask=mask)
        return output.reshape(len(group.chunks), -1)


def chunk_mask(tokens: int, position: int, window: int | None, *, device: torch.device) -> torch.Tensor | None:
    """Gives the boolean mask of `tokens` queries after `position` cached tokens over keys [0, position + tokens),
    or None where SDPA's causal flag is exact (a chunk starting at 0 whose window, if any, covers it)."""
    end = position + tokens
    window_active = window is not None and end > window
    if position == 0 and not window_active:
        return None
    query_positions = torch.arange(position, end, device=device)[:, None]
    key_positions = torch.arange(end, device=device)[None, :]
    allowed = key_positions <= query_positions
    if window_active:
        allowed &= key_positions > query_positions - window
    return allowed[None, None]
