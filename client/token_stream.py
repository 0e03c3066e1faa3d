"""Tokens one at a time from the swarm, with a sampler of the request's own: what an API server streams.

`generate()` (transformers' loop) samples from torch's global random state, which threads generating at once share,
so a seed cannot make one request's sampling reproducible; it also cannot be stopped between tokens from outside.
`stream_tokens` runs the same steps (one inference session, the prompt as a prefill, then one token per step through
the same batched head) with a `Sampler` that owns its `torch.Generator`, and checks `cancelled` before every step.
Greedy decoding (temperature 0) takes the argmax, as `generate(do_sample=False)` does.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from client.inference import InferenceSession
    from client.model import DistributedModelForCausalLM


@dataclass
class Sampler:
    """Chooses the next token from logits: greedy at temperature 0, else temperature then nucleus (top-p) sampling,
    with transformers' rules for both, from a generator seeded by `seed` (random when None)."""

    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    generator: torch.Generator = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        self.generator = torch.Generator()
        if self.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(self.seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def choose(self, logits: torch.Tensor) -> int:
        """Gives the token for one row of logits (vocabulary-sized)."""
        if self.greedy:
            return int(logits.argmax())
        scores = logits.float() / self.temperature
        if self.top_p < 1:
            # transformers' TopPLogitsWarper: drop the least likely tokens whose total stays within 1 - top_p
            ordered, order = torch.sort(scores, descending=False)
            cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
            remove = cumulative <= 1 - self.top_p
            remove[-1] = False  # keep at least the most likely token
            scores = scores.masked_fill(remove.scatter(0, order, remove), -float("inf"))
        probabilities = scores.softmax(dim=-1)
        return int(torch.multinomial(probabilities, 1, generator=self.generator))


def stream_tokens(
    model: DistributedModelForCausalLM, prompt_ids: list[int], *, max_new_tokens: int, sampler: Sampler,
    eos_token_ids: frozenset[int] = frozenset(), cancelled: threading.Event | None = None,
    on_end: Callable[[InferenceSession], None] | None = None,
) -> Iterator[int]:
    """Yields up to `max_new_tokens` tokens after `prompt_ids`, ending after an EOS token (yielded) or once
    `cancelled` is set (checked before every step). The session closes, and the servers free its pages, when the
    iterator ends or is closed; `on_end` then sees it (e.g. its failovers)."""
    if not prompt_ids:
        raise ValueError("the prompt has no tokens")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    ids = torch.tensor([prompt_ids], dtype=torch.long)
    session = model.inference_session(max_length=len(prompt_ids) + max_new_tokens, prompt_tokens=len(prompt_ids))
    try:
        with session, model.use_session(session), torch.inference_mode():
            for _ in range(max_new_tokens):
                if cancelled is not None and cancelled.is_set():
                    return
                logits = model(ids, logits_to_keep=1).logits[0, -1]
                token = sampler.choose(logits)
                yield token
                if token in eos_token_ids:
                    return
                ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    finally:
        if on_end is not None:
            on_end(session)
