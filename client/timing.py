"""A streamer that stamps when generate() emits each token, for measuring time to first token and decode speed."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from transformers.generation.streamers import BaseStreamer


class StepClock(BaseStreamer):
    """Stamps the time of every put: the first put is the prompt, each later one a generated token (for a batched
    generate(), one token of every sequence). `on_first_token` runs when the first generated token arrives."""

    def __init__(self, on_first_token: Callable[[], None] | None = None) -> None:
        self.stamps_s: list[float] = []
        self.on_first_token = on_first_token

    def put(self, value: torch.Tensor) -> None:
        self.stamps_s.append(time.perf_counter())
        if len(self.stamps_s) == 2 and self.on_first_token is not None:
            self.on_first_token()

    def end(self) -> None:
        pass
