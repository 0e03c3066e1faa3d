"""Spot-checks of servers' outputs: a client's defence against a server that returns wrong hidden states (Petals'
client has none).

With `ClientConfig.verify_fraction` f, each step is drawn with probability f (a seeded or OS-random draw the servers
cannot predict). A drawn step runs span by span (no push: the client must see every span's output), and after each
span answered, other servers recompute its blocks: one that hosts them all, or a chain of several that cover them
(fewest hops first), gets fresh sessions and the span's whole input history at once (a prefill), and their outputs
for the step's tokens are compared with the span's.
Outputs agree within the tolerance of the looser of the two servers' dtypes (`TOLERANCES`): a prefill and a chain
of decode steps round differently, so exact equality is not expected. On a disagreement a third server decides:
the one of the two that disagrees with it is banned for `cheat_ban_s` (a checking chain of several servers that
was wrong is not: the client cannot tell which of them was). A caught span server is replaced, with the
spans after it (their KV was built from its outputs), by a replay of the span's inputs, and the step goes on there;
a caught checker is only banned. With no third server, the client cannot tell which is right and fails the step
with `WrongOutput`. Spot-checks bound how long a cheater serves unnoticed; tokens it influenced before a check
caught it are not taken back (verify_fraction 1 checks every step before its output is used).
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from client.routing import Span
from swarm.errors import SwarmError, WrongOutput
from swarm.records import ServerRecord, ServerState

if TYPE_CHECKING:
    from client.inference import RemoteInferenceSession

log = logging.getLogger(__name__)

# (rtol, atol) by dtype: float32 differs by rounding order only; half precision and quantized weights by far more
TOLERANCES = {"float32": (1e-3, 1e-3), "float16": (5e-2, 5e-2), "bfloat16": (5e-2, 5e-2)}
QUANTIZED_TOLERANCE = (1e-1, 1e-1)


@dataclass
class CheckStats:
    """What one session's spot-checks did."""

    checked: int = 0  # spans whose step another server recomputed
    unchecked: int = 0  # spans no other server could recompute
    disagreed: int = 0
    caught: int = 0  # servers banned for wrong outputs


def tolerance(*records: ServerRecord) -> tuple[float, float]:
    """Gives the (rtol, atol) of outputs of servers announcing these records: the loosest of theirs."""
    found = [QUANTIZED_TOLERANCE if record.quant != "none" else TOLERANCES.get(record.dtype, QUANTIZED_TOLERANCE)
             for record in records]
    return max(rtol for rtol, _ in found), max(atol for _, atol in found)


def agree(first: torch.Tensor, second: torch.Tensor, rtol: float, atol: float) -> bool:
    """Gives whether two servers' outputs for the same tokens agree within (rtol, atol)."""
    return first.shape == second.shape and torch.allclose(first.float(), second.float(), rtol=rtol, atol=atol)


class SpotChecker:
    """Draws the steps to check and recomputes spans on other servers."""

    def __init__(self, fraction: float, seed: int | None = None) -> None:
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"verify_fraction must lie in [0, 1], got {fraction}")
        self.fraction = fraction
        self.rng = random.Random(seed) if seed is not None else random.SystemRandom()
        self.stats = CheckStats()

    def draw(self) -> bool:
        """Gives whether the coming step is checked."""
        return self.fraction > 0 and self.rng.random() < self.fraction

    async def check(self, session: RemoteInferenceSession, span: Span, inputs: torch.Tensor,
                    output: torch.Tensor) -> str | None:
        """Gives the peer to ban after checking `output` (the span's answer to the last `output.shape[1]` of
        `inputs`, the span's whole input history): the span's server, the checker's, or None if both agree, no
        other servers cover the blocks, or a checking chain of several servers was wrong (which of them, the client
        cannot tell); raises WrongOutput if two disagree and no third can decide."""
        tokens = output.shape[1]
        second = await self._recompute(session, span, inputs, tokens, exclude={span.peer_id})
        if second is None:
            self.stats.unchecked += 1
            return None
        self.stats.checked += 1
        checkers, recomputed = second
        if agree(output, recomputed, *tolerance(span.record, *checkers)):
            return None
        self.stats.disagreed += 1
        gap = (output.float() - recomputed.float()).abs().max().item()
        checker_ids = {record.peer_id for record in checkers}
        third = await self._recompute(session, span, inputs, tokens, exclude={span.peer_id} | checker_ids)
        if third is None:
            raise WrongOutput(f"servers {span.peer_id} and {_names(checkers)} disagree on blocks "
                              f"{span.start}:{span.end} (by up to {gap:.3g}) and no third server hosts them to tell "
                              f"which is right")
        referees, decided = third
        span_right = agree(output, decided, *tolerance(span.record, *referees))
        if span_right and len(checkers) > 1:
            log.warning("Servers %s disagree with %s on blocks %d:%d, which %s confirm; one of them is wrong",
                        _names(checkers), span.peer_id, span.start, span.end, _names(referees))
            return None
        cheat = checkers[0].peer_id if span_right else span.peer_id
        self.stats.caught += 1
        log.warning("Server %s returned wrong outputs for blocks %d:%d (off by up to %.3g; %s agree with %s); "
                    "banning it", cheat, span.start, span.end, gap, _names(referees),
                    span.peer_id if span_right else _names(checkers))
        session.client.ban(cheat, session.client.config.cheat_ban_s)
        return cheat

    async def _recompute(self, session: RemoteInferenceSession, span: Span, inputs: torch.Tensor, tokens: int, *,
                         exclude: set[str]) -> tuple[list[ServerRecord], torch.Tensor] | None:
        """Gives the records of other servers that cover the span's blocks, one or a chain of several, and their
        outputs for the last `tokens` of `inputs`, from fresh sessions there (None if no servers can: none cover
        the blocks, or they refuse). A server that refuses is left out and the cover chosen again."""
        banned = session.client.banned() | exclude
        candidates = [record for peer, record in sorted((await session.client.servers()).items())
                      if peer not in banned and record.state == ServerState.online
                      and record.block_start < span.end and span.start < record.block_end]
        self.rng.shuffle(candidates)
        while (chain := cover(candidates, span.start, span.end)) is not None:
            hidden = inputs
            for part in chain:
                try:
                    hidden = await self._run_part(session, part, hidden)
                except SwarmError as error:
                    log.info("Server %s failed to check blocks %d:%d (%s)", part.peer_id, part.start, part.end,
                             error.message)
                    candidates.remove(part.record)
                    break
            else:
                return [part.record for part in chain], hidden[:, -tokens:]
        return None

    @staticmethod
    async def _run_part(session: RemoteInferenceSession, part: Span, hidden: torch.Tensor) -> torch.Tensor:
        opened = await session.open_span(part)
        try:
            return await session.call_step(opened, hidden, step_id="verify")
        finally:
            await session.close_span(opened)


def cover(records: list[ServerRecord], start: int, end: int) -> list[Span] | None:
    """Gives spans of these servers, in their order where they tie, that chain over blocks [start, end) with the
    fewest hops (each hop reaches as far as any server does), or None if they leave a gap."""
    chain: list[Span] = []
    position = start
    while position < end:
        hosting = [record for record in records if record.block_start <= position < record.block_end]
        if not hosting:
            return None
        best = max(hosting, key=lambda record: min(record.block_end, end))  # max keeps the first of equals
        chain.append(Span(best.peer_id, position, min(best.block_end, end), best))
        position = chain[-1].end
    return chain


def _names(records: list[ServerRecord]) -> str:
    return "+".join(record.peer_id for record in records)
