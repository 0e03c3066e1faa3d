"""Generations for HTTP requests: prompts to tokens, tokens from the swarm in worker threads, tokens to text.

Each request runs `client.token_stream.stream_tokens` in a thread of its own (one inference session each, so
concurrent requests are concurrent swarm sessions, which the servers batch). The thread hands tokens to the
request's asyncio task through a queue. Text is decoded from all tokens so far, and what is new is emitted, except:
- the end of a multi-byte character that has not fully arrived (the decoder shows U+FFFD for it);
- a tail that may be the start of a stop sequence; when one completes, the text ends before it.
A request whose HTTP client went away, or that ran out of time, sets its `cancelled` event: the thread stops before
its next step and the session closes, so the servers free its pages.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from dataclasses import dataclass, field
from typing import Any, Literal

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from api.errors import ApiError, bad_request, from_swarm, timed_out
from api.metrics import ApiMetrics
from client.model import DistributedModelForCausalLM
from client.token_stream import Sampler, stream_tokens
from swarm.errors import SwarmError

log = logging.getLogger(__name__)

FinishReason = Literal["stop", "length"]
INCOMPLETE = "\ufffd"
LIMIT_TTL_S = 10.0


@dataclass
class Delta:
    """New text of a generation, and once it ended, why."""

    text: str
    tokens: int  # tokens generated so far
    finish_reason: FinishReason | None = None


@dataclass
class TextTracker:
    """Turns the tokens of one generation into text deltas, ending at the first stop sequence."""

    tokenizer: PreTrainedTokenizerBase
    stops: list[str]
    ids: list[int] = field(default_factory=list)
    sent: int = 0  # characters of the text emitted so far
    stopped: bool = False

    def add(self, token: int) -> str:
        """Gives the text that `token` makes safe to emit (sets `stopped` if a stop sequence completed)."""
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cut = min((index for stop in self.stops if (index := text.find(stop, max(0, self.sent - len(stop)))) >= 0),
                  default=-1)
        if cut >= 0:
            self.stopped = True
            return self._emit(text[:cut])
        end = len(text)
        while end > self.sent and text[end - 1] == INCOMPLETE:
            end -= 1
        for stop in self.stops:  # hold back a tail that a stop sequence may begin with
            for length in range(min(len(stop) - 1, end - self.sent), 0, -1):
                if stop.startswith(text[end - length:end]):
                    end -= length
                    break
        return self._emit(text[:end])

    def finish(self) -> str:
        """Gives what was held back, once the generation ended without a stop sequence."""
        return "" if self.stopped else self._emit(self.tokenizer.decode(self.ids, skip_special_tokens=True))

    def _emit(self, text: str) -> str:
        new = text[self.sent:]
        self.sent = max(self.sent, len(text))
        return new


class Engine:
    """The swarm client, the tokenizer and the threads that generate for `swarm-api`."""

    def __init__(self, model: DistributedModelForCausalLM, *, names: list[str], max_concurrency: int,
                 timeout_s: float, metrics: ApiMetrics, tokenizer: PreTrainedTokenizerBase | None = None) -> None:
        self.model = model
        self.metrics = metrics
        self.names = names  # the first is the name models are listed under; requests may use any
        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(model.source.path)
        self.timeout_s = timeout_s
        self.context_length = int(getattr(model.config, "max_position_embeddings", 2048))
        self.eos = frozenset(_ids(model.generation_config.eos_token_id) + _ids(self.tokenizer.eos_token_id))
        self._threads = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="generation")
        self._longest: tuple[int, float] | None = None  # (tokens, when)

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        """Gives the tokens of `messages` in the model's chat template, ready for the assistant's turn."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise bad_request("this model has no chat template: use /v1/completions", param="messages")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.text_prompt(text, add_special_tokens=False)

    def text_prompt(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    async def budget(self, prompt: list[int], requested: int | None, param: str) -> int:
        """Gives the new tokens a request may generate: `requested`, or what the longest session left has room for
        (the model's context, or the longest session a chain of the swarm's servers takes, if shorter)."""
        if not prompt:
            raise bad_request("the prompt is empty", param="prompt")
        longest = min(self.context_length, await self.longest_session())
        left = longest - len(prompt)
        if requested is None:
            requested = left
        if requested > left or left < 1:
            raise bad_request(f"the prompt's {len(prompt)} tokens and {param} = {requested} exceed the {longest} "
                              f"tokens a session can hold (the model's context and the servers' --max-length)",
                              param=param)
        return requested

    async def longest_session(self) -> int:
        """Gives the longest session some chain of the online servers takes (refreshed every `LIMIT_TTL_S`; the
        model's context while a block has no server: such a request waits for one, then fails with 503)."""
        now = time.monotonic()
        if self._longest is None or now - self._longest[1] > LIMIT_TTL_S:
            swarm = self.model.swarm
            try:
                records = await asyncio.to_thread(swarm.run, swarm.servers())
            except (SwarmError, TimeoutError) as error:  # the generation will meet the same trouble, and say so
                log.info("reading the servers' session limits failed: %s", error)
                return self.context_length
            per_block = [max((record.max_length for record in records.values() if block in record.block_range),
                             default=0) for block in range(self.model.source.num_blocks)]
            longest = min(per_block, default=0)
            self._longest = (longest if longest > 0 else self.context_length, now)
        return self._longest[0]

    async def generate(self, prompt: list[int], *, max_new_tokens: int, temperature: float, top_p: float,
                       seed: int | None, stops: list[str]) -> AsyncIterator[Delta]:
        """Yields the text deltas of one generation; raises ApiError before the first if it cannot start. Closing
        the iterator early (the HTTP client left) stops the generation."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        cancelled = threading.Event()
        sampler = Sampler(temperature=temperature, top_p=top_p, seed=seed)

        def run() -> None:
            if cancelled.is_set():  # it waited for a thread, and its client has gone since
                return
            try:
                tokens = stream_tokens(self.model, prompt, max_new_tokens=max_new_tokens, sampler=sampler,
                                       eos_token_ids=self.eos, cancelled=cancelled,
                                       on_end=lambda session: metrics.failovers.inc(session.failovers))
                with closing(tokens):  # closing it closes the session
                    for token in tokens:
                        loop.call_soon_threadsafe(queue.put_nowait, ("token", token))
                        if cancelled.is_set():
                            break
                loop.call_soon_threadsafe(queue.put_nowait, ("end", None))
            except Exception as error:  # the request's task turns it into an HTTP error
                loop.call_soon_threadsafe(queue.put_nowait, ("error", error))

        tracker = TextTracker(self.tokenizer, stops)
        metrics = self.metrics
        started = loop.time()
        deadline = started + self.timeout_s
        loop.run_in_executor(self._threads, run)
        metrics.generations.inc()
        try:
            while True:
                try:
                    kind, item = await asyncio.wait_for(queue.get(), max(0.0, deadline - loop.time()))
                except TimeoutError:
                    raise timed_out(self.timeout_s) from None
                if kind == "error":
                    raise item if isinstance(item, ApiError) else from_swarm(item)
                if kind == "token":
                    metrics.tokens.inc()
                    if not tracker.ids:
                        metrics.first_token_seconds.observe(loop.time() - started)
                if kind == "end":
                    reason: FinishReason = "stop" if tracker.ids and tracker.ids[-1] in self.eos else "length"
                    yield Delta(tracker.finish(), len(tracker.ids), reason)
                    return
                text = tracker.add(int(item))
                if tracker.stopped:
                    yield Delta(text, len(tracker.ids), "stop")
                    return
                if text:
                    yield Delta(text, len(tracker.ids))
        finally:
            cancelled.set()
            metrics.generations.dec()

    def shutdown(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
        self.model.shutdown()


def _ids(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else list(value)


__all__ = ["ApiError", "Delta", "Engine", "TextTracker"]
