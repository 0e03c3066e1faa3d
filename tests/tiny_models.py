"""Tiny random checkpoints (Llama, Qwen2, Mistral) written to disk, so tests never need a model hub, and a
character-level tokenizer of their vocabulary for the processes that need text (`swarm-api`)."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

COMMON = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)


def tiny_config(family: str, **overrides: object) -> PretrainedConfig:
    """Gives a small random-model config of `family` with 8 blocks and grouped-query attention."""
    if family == "llama":
        return LlamaConfig(**{**COMMON, "tie_word_embeddings": False, **overrides})
    if family == "qwen2":
        return Qwen2Config(**{**COMMON, "tie_word_embeddings": True, **overrides})
    if family == "mistral":
        return MistralConfig(**{**COMMON, "sliding_window": None, "tie_word_embeddings": False, **overrides})
    raise ValueError(family)


def write_tiny_checkpoint(family: str, path: Path, *, seed: int = 0, **overrides: object) -> Path:
    """Gives `path` holding a seeded random checkpoint of `family` (config fields overridden) in safetensors form,
    with a character tokenizer (`write_char_tokenizer`) so that processes that need text can serve it."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides), dtype=torch.float32)
    # random init leaves logits nearly flat; scale up so greedy decoding has clear winners
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.mul_(4.0) if parameter.dim() > 1 else None
    model.save_pretrained(path)
    return write_char_tokenizer(path)


CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant: {% endif %}")


def write_char_tokenizer(path: Path) -> Path:
    """Writes into `path` a tokenizer of the tiny vocabulary: one token per character, printable ASCII and newline
    at their own codes, `<pad>`, `<s>`, `</s>` and `<unk>` at 0-3 (the configs' special ids), with a chat template."""
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, "\n": 10, **{chr(code): code for code in range(32, 127)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>", clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    return path
