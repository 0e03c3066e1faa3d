"""Inference sessions of one server: their page tables in the pool, positions, steps, duplicate replies, timeouts.

A session's whole life is here: opened (admitted by the headroom rule, with its first page per block and row),
grown page by page before each chunk it computes, committed step by step, closed. Everything runs on the server's
event loop; compute threads only read the page tables of the sessions in the batch they compute, which hold their
pages until that batch ends even if they close meanwhile.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from orchestrator.admission import (
    ClientQuota,
    KVPolicy,
    NamedWait,
    SessionKV,
    SessionPace,
    averaged_interval,
    pages_kept_for_named,
    room_in_s,
)
from swarm.errors import (
    BlocksNotHosted,
    Hop,
    MaxLengthExceeded,
    OutOfPages,
    QuotaExceeded,
    ServerBusy,
    SessionNotFound,
    SwarmError,
)
from swarm.memory import KVOwner, PagePool, kv_pages_for
from swarm.model.paged_kv import SequenceChunk
from swarm.records import NextHop

if TYPE_CHECKING:
    from server.remote_attention import RemoteKV

MAX_BATCH_ROWS = 64
EVICTED_TTL_S = 900.0  # how long an evicted session's steps still learn why it went
MAX_REMEMBERED = 4096  # evicted and refused sessions kept in mind at most
# How long a session refused for room counts in the demand (KunServe's trigger): a client that every server
# refused asks again after its backoff, at most 4 s (`client.inference`), so it is still waiting until then.
REFUSED_WINDOW_S = 5.0
# When to ask again, told to a client refused for room while a drop is freeing pages that would admit it (the
# dropped blocks unload as their victims' KV leaves, within a second or two): sooner than its doubling backoff
SOON_RETRY_MS = 250


@dataclass(frozen=True)
class StepResult:
    """A computed step: the hidden states after the session's last block, the compute time of the batches it went
    through, and how many they were (a long prompt computes chunk by chunk)."""

    output: torch.Tensor
    compute_ms: float
    batches: int = 1


@dataclass
class RefusedWait:
    """A wait this server refused for room (a client's `wait_id` across its tries, else one session): its latest and
    first refusal, the pages it would take, and, if the latest refusal named a time for room, when that is and whose
    wait it is (`orchestrator.admission.pages_kept_for_named`)."""

    last_s: float
    pages: int
    first_s: float
    room_at_s: float | None = None
    client: str = ""


@dataclass
class Session:
    """One client's attention state for blocks [start, end) of this server, growing up to `max_length` tokens."""

    session_id: str
    start: int
    end: int
    batch: int
    max_length: int
    # block -> batch row -> page ids in token order; mutated only between batches
    page_tables: dict[int, list[list[int]]] = field(default_factory=dict)
    position: int = 0  # tokens committed: visible to attention
    last_step_id: str | None = None
    last_result: StepResult | None = None
    running: Step | None = None  # the step queued or computing now (one at a time)
    in_batches: int = 0  # batches computing with its pages now; its pages stay its own until this drops to 0
    closed: bool = False
    evicted: SwarmError | None = None  # why the server closed it, if it did (its steps get this error)
    # Resolved (and replaced) whenever a step is admitted, for requests waiting for a pushed step.
    admitted: asyncio.Future[None] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    last_active_s: float = field(default_factory=time.monotonic)
    # The time between its committed decode steps here (a running average: its client's time per token, as this
    # server sees it), None until two have committed; and when the last one did
    step_interval_s: float | None = None
    last_commit_s: float | None = None
    opener: str = ""  # the peer that opened it (its client), also after it migrated here
    prompt_tokens: int = 0  # the tokens its client said its first step brings (its expected growth starts there)
    lease_id: str | None = None  # the orchestrator's lease its client runs it under, if any
    importing_from: str | None = None  # the source server while its KV arrives; it takes no steps until then
    moving: asyncio.Future[None] | None = None  # set while its KV leaves for another server: its steps wait
    merging: tuple[str, int, int] | None = None  # (source, start, end) while a peer's part of it arrives
    # Once split or merged with peers (KunServe's exchange and restore): the servers that run the blocks its client
    # last saw it over, which steps that still expect it there are told of.
    hops: list[Hop] | None = None
    # The servers (peer id, addresses) that a move or a lending from here opened a part of it on, while its client
    # has not yet been told the new chain (`ChainChanged`): closed here, it closes there (`take_untold_parts`).
    untold: list[tuple[str, list[str]]] = field(default_factory=list)
    next_hop: NextHop | None = None  # the server after this one in its client's chain, as its last step named it
    later_hops: int = 0  # how many servers its last step named after this one (a restore merges the last first)
    # While some of its blocks' KV is still on the server that dropped them (KunServe's live exchange): where, and
    # how far each block's copy got (`server.remote_attention.RemoteKV`); its steps compute outside batches then.
    remote: RemoteKV | None = None
    # Set from a drop until KunServe's blocking exchange moved its KV for the dropped blocks (or gave up on it): its
    # steps wait, so it computes nothing here, and the dropped blocks' parameters go at once (`waits_for_exchange`).
    awaiting_exchange: asyncio.Future[None] | None = None

    @property
    def blocks(self) -> int:
        return self.end - self.start

    def note_committed(self, tokens: int, now: float) -> None:
        """Notes that a step of `tokens` tokens committed at `now`: a decode step after another one updates
        `step_interval_s`."""
        if tokens == 1 and self.last_commit_s is not None:
            self.step_interval_s = averaged_interval(self.step_interval_s, now - self.last_commit_s)
        self.last_commit_s = now

    @property
    def waits_for_exchange(self) -> bool:
        """Whether it waits for the blocking exchange and no step or batch of it computes now."""
        return self.awaiting_exchange is not None and self.running is None and self.in_batches == 0

    @property
    def settling(self) -> bool:
        """Whether its first step (its prompt, or the replay that rebuilds it) has not arrived yet."""
        return self.position == 0 or self.position < self.prompt_tokens

    @property
    def steps_left(self) -> int:
        """Gives the steps it is expected to take yet, if it runs to its max_length: its announced prompt as one step
        (until it has arrived), then one a token until its position is one short of max_length (a client's last
        token is generated, never fed back)."""
        if self.position < self.prompt_tokens:
            return 1 + max(0, self.max_length - 1 - self.prompt_tokens)
        return max(0, self.max_length - 1 - self.position)

    @property
    def pages_held(self) -> int:
        return sum(len(pages) for rows in self.page_tables.values() for pages in rows)

    def chunks(self, first_row: int, offset: int, tokens: int) -> list[SequenceChunk]:
        """Gives one chunk per batch row for `tokens` tokens starting `offset` tokens after the committed position,
        their rows numbered from `first_row` (row-major: all of row 0's tokens, then row 1's)."""
        return [
            SequenceChunk(
                first_row + row * tokens, tokens, self.position + offset, self.start, self.end,
                {block: rows[row] for block, rows in self.page_tables.items()},
            )
            for row in range(self.batch)
        ]


@dataclass
class Step:
    """A step admitted for computing: one session's new tokens, how far they got, and who awaits the result."""

    session: Session
    step_id: str | None
    hidden: torch.Tensor  # [batch rows, tokens, hidden], in the blocks' dtype
    result: asyncio.Future[StepResult]
    next_hops: list[NextHop] = field(default_factory=list)
    compression: str | None = None
    done: int = 0  # tokens per row computed so far
    outputs: list[torch.Tensor] = field(default_factory=list)
    compute_ms: float = 0.0
    admitted_s: float = field(default_factory=time.perf_counter)
    beside_prefill: bool = False  # whether a batch it computed in also computed a prefill chunk
    stopping: bool = False  # it ends with StepStopped where the batch computing it ends (`StepScheduler.stop_step`)

    @property
    def tokens(self) -> int:
        return self.hidden.shape[1]

    @property
    def rows(self) -> int:
        return self.hidden.shape[0]

    @property
    def remaining(self) -> int:
        return self.tokens - self.done


class SessionTable:
    """Opens, finds, grows and closes sessions; every session's KV lives in pages of the server's one pool."""

    def __init__(
        self, *, block_start: int, block_end: int, pool: PagePool, tokens_per_page: int, max_length: int,
        headroom_tokens: int, quota: ClientQuota | None = None, clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`quota`: what one client may hold here (`orchestrator.admission.ClientQuota`; None: no cap). `clock`: the
        seconds the refused waits, the holds and the evictions are timed by (a session's activity: `time.monotonic`)."""
        self.block_start, self.block_end = block_start, block_end
        self.pool = pool
        self.tokens_per_page = tokens_per_page
        self.max_length = max_length
        self.policy = KVPolicy(tokens_per_page, headroom_tokens)
        self.quota = quota or ClientQuota(max_sessions=0, kv_share=1.0)
        self.clock = clock
        self._sessions: dict[str, Session] = {}
        self._closing: dict[str, Session] = {}  # closed while a batch computes with them; freed when it ends
        self._untold_parts: list[tuple[str, str, list[str]]] = []  # (session, peer, addresses) to close on the peer
        self._evicted: OrderedDict[str, tuple[float, SwarmError]] = OrderedDict()  # id -> (when, what its steps get)
        # a waiting session's key (its client's `wait_id`, else its id) -> its wait, of opens refused for room
        self._refused: OrderedDict[str, RefusedWait] = OrderedDict()
        self._opened: OrderedDict[str, float] = OrderedDict()  # such a key -> when a session with it opened here
        # Pages a drop holds back from new sessions for the KV its group-mates' victims bring (`hold_for_exchange`):
        # how many are left, how long the hold lasts without an import, and when one last ran.
        self._held_for_exchange, self._hold_idle_s, self._hold_active_s = 0, 0.0, 0.0
        # Pages about to return to the pool: the parameters of dropped blocks that unload once no session computes
        # over them (`server.hosting.Hosting.retiring_pages`, wired by the server)
        self.pages_coming: Callable[[], int] = lambda: 0

    def __len__(self) -> int:
        return len(self._sessions)

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(list(self._sessions.values()))

    def growth_reserve(self) -> int:
        """Gives the free pages the open sessions are expected to still take (the headroom rule)."""
        return self.policy.growth_reserve(self._kv_of(session) for session in self._sessions.values())

    def hold_for_exchange(self, pages: int, *, idle_s: float = 0.0) -> None:
        """Holds `pages` free pages back from new sessions for the KV a drop's exchange brings here (spec 5.2: the
        pages a drop frees, less what its group-mates' victims will take, are what new sessions may have at once).
        Each session imported meanwhile takes its pages out of the hold; the rest lapses once no import has run for
        `idle_s` (the victims' servers stop waiting for room after as long). 0 ends the hold."""
        self._held_for_exchange, self._hold_idle_s = max(0, pages), idle_s
        self._hold_active_s = self.clock()

    def held_for_exchange(self) -> int:
        """Gives the pages still held back for a drop's exchange (0 once the hold lapsed)."""
        if not self._held_for_exchange:
            return 0
        now = self.clock()
        if any(session.importing_from is not None for session in self._sessions.values()):
            self._hold_active_s = now
        elif now - self._hold_active_s > self._hold_idle_s:
            self._held_for_exchange = 0
        return self._held_for_exchange

    def pages_for(self, session: Session, tokens: int) -> int:
        """Gives the pages `session` holds at `tokens` tokens, over all its blocks and rows."""
        return session.blocks * session.batch * kv_pages_for(tokens, self.tokens_per_page)

    def packed_pages(self, session: Session) -> int:
        """Gives the pages `session` is packed with by its segment's packing: what it holds, or what its announced
        prompt will take once its first step arrives (a new session is packed at its size, not at one page)."""
        return max(session.pages_held, self.pages_for(session, session.prompt_tokens))

    def prompt_reserve(self) -> int:
        """Gives the free pages the open sessions' announced prompts are still to take."""
        return sum(self.packed_pages(session) - session.pages_held for session in self._sessions.values())

    def _kv_of(self, session: Session) -> SessionKV:
        expected = self.policy.expected_pages(
            tokens=max(session.position, session.prompt_tokens), max_length=session.max_length,
            sequences=session.blocks * session.batch,
        )
        return SessionKV(pages_held=session.pages_held, pages_expected=expected)

    def set_range(self, block_start: int, block_end: int) -> None:
        """Makes [block_start, end) the blocks new sessions may open on (empty: none); open sessions keep theirs."""
        self.block_start, self.block_end = block_start, block_end

    def uses_block(self, block: int) -> bool:
        """Gives whether a session, open or closed while a batch still computes with it, covers `block` (a victim
        waiting for the blocking exchange computes nothing and does not count)."""
        return any(
            session.start <= block < session.end and not session.waits_for_exchange
            for session in (*self._sessions.values(), *self._closing.values())
        )

    def sessions_fit(self) -> int:
        """Gives how many new one-row sessions over every hosted block the headroom rule would admit now."""
        if self.block_end <= self.block_start:
            return 0
        per_session = self.policy.expected_pages(
            tokens=0, max_length=self.max_length, sequences=self.block_end - self.block_start
        )
        return self.policy.sessions_fit(
            pages_free=self.pool.pages_free,
            reserve=self.growth_reserve() + self.held_for_exchange() + self.kept_for_named(),
            pages_per_session=per_session,
        )

    def check_hosted(self, start: int, end: int) -> None:
        """Raises BlocksNotHosted unless [start, end) is a non-empty part of the blocks new sessions may open on."""
        if not (self.block_start <= start < end <= self.block_end):
            hosted = f"hosts {self.block_start}:{self.block_end}" if self.block_end > self.block_start else "hosts none"
            raise BlocksNotHosted(f"blocks {start}:{end} requested, but this server {hosted} for new sessions",
                                  {"block_start": self.block_start, "block_end": max(self.block_start, self.block_end)})

    def open(
        self, session_id: str, start: int, end: int, *, batch: int, max_length: int, opener: str = "", tokens: int = 1,
        prompt_tokens: int = 0, moved_in: bool = False, wait_id: str = "", kv_elsewhere: bool = False,
    ) -> Session:
        """Gives a new session holding pages for its first `tokens` tokens (1: its first page) per block and row, or
        raises a typed error and holds nothing.

        Admission (`orchestrator.admission`): a session is expected to grow to its prompt (`prompt_tokens`, what
        its client said its first step brings) and then by the headroom. A session that `moved_in` by migration is
        admitted on the pages it needs now, next to the prompts announced here and not yet arrived: whoever moved
        it here (its segment's packing, a drain, its client) chose this server for it, and the sessions here keep
        taking free pages as they grow.

        `wait_id` names the client's wait for this session across its tries (each try opens with a new session id):
        a refusal counts in `kv_demand_pages` under it, once however often the client tries, until it opens.

        With `kv_elsewhere` (a victim of KunServe's live exchange, its KV still lent by the server that dropped its
        blocks) the session opens with no pages, however few are free: it takes them block by block as its KV
        follows (`grow_block`), and attends through the lender meanwhile."""
        self.check_hosted(start, end)
        if not 0 < max_length <= self.max_length:
            raise MaxLengthExceeded(f"max_length {max_length} is outside 1..{self.max_length} (the server's limit)")
        if not 0 < batch <= MAX_BATCH_ROWS:
            raise MaxLengthExceeded(f"batch {batch} is outside 1..{MAX_BATCH_ROWS}")
        if session_id in self._sessions or session_id in self._closing:
            raise ServerBusy(f"session {session_id!r} is already open on this server, or still closing")
        if not 0 < tokens <= max_length:
            raise MaxLengthExceeded(f"a session of {tokens} tokens does not fit its max_length {max_length}")
        prompt_tokens = min(max(0, prompt_tokens), max_length)
        sequences = (end - start) * batch
        if opener and self.quota.refuses_session(sum(1 for s in self._sessions.values() if s.opener == opener)):
            raise QuotaExceeded(f"client {opener} already holds {self.quota.max_sessions} sessions on this server, "
                                f"as many as one client may")
        now_pages = 0 if kv_elsewhere else sequences * kv_pages_for(tokens, self.tokens_per_page)
        self._check_pages_quota(opener, now_pages)
        held = self.held_for_exchange()
        if moved_in:  # an exchange's victim among them: the held pages are for it
            expected, reserve = now_pages, self.prompt_reserve()
        else:
            expected = self.policy.expected_pages(tokens=max(tokens - 1, prompt_tokens), max_length=max_length,
                                                  sequences=sequences)
            reserve = self.growth_reserve() + held
        key = wait_id or session_id
        # the room named to the waits before this one, about their time (a moved session's place was chosen for it)
        kept = 0 if moved_in or kv_elsewhere else self.kept_for_named(key)
        pages_free = self.pool.pages_free
        # A lent victim takes no page now, and its KV comes only into room (`grow_block`): refusing it would keep
        # the lender's dropped blocks in use, whose pages are the room its group-mates' victims wait for
        if not kv_elsewhere and not self.policy.admits(pages_free=pages_free, reserve=reserve + kept,
                                                       new_session_pages=expected):
            wait = self._note_refused(key, expected, opener)
            coming = self.pages_coming()
            soon = coming > 0 and self.policy.admits(pages_free=pages_free + coming, reserve=reserve + kept,
                                                     new_session_pages=expected)
            # (the waits before it count in its room time, kept or not)
            room_s = None if soon else self.room_in_s(key, pages_free=pages_free, reserve=reserve,
                                                      new_session_pages=expected)
            wait.room_at_s = None if room_s is None else wait.last_s + room_s
            retry_after_ms = SOON_RETRY_MS if soon else None if room_s is None else max(1, round(room_s * 1000))
            raise ServerBusy(
                f"no room for a session of {end - start} blocks x {batch} row(s): it is expected to take {expected} "
                f"pages, {pages_free} are free and the {len(self)} open session(s) are expected to take "
                f"{reserve - (0 if moved_in else held)} more as they grow"
                + (f"; {held} are held for the KV a drop's exchange brings" if held and not moved_in else "")
                + (f"; {kept} are kept for waits refused before it, whose named time for room is about now"
                   if kept else "")
                + (f"; {coming} more return as dropped blocks unload: ask again in {SOON_RETRY_MS} ms" if soon
                   else f"; its open sessions' ends are expected to make room in {room_s:.2f} s" if room_s is not None
                   else ""),
                {"retry_after_ms": retry_after_ms} if retry_after_ms is not None else None,
            )
        if moved_in and held:
            self._held_for_exchange = max(0, held - expected)
            self._hold_active_s = self.clock()
        session = Session(session_id, start, end, batch, max_length, opener=opener, prompt_tokens=prompt_tokens)
        self._sessions[session_id] = session
        self._note_opened(key)  # it holds pages now: no longer a demand beside them
        if kv_elsewhere:
            return session
        try:
            self._grow(session, tokens)
        except BaseException:
            self.close(session_id)
            raise
        return session

    def grow(self, session: Session, tokens: int) -> None:
        """Gives `session` pages for `tokens` tokens per row in every block (all or nothing); raises ServerBusy
        when the pool has too few free pages, so the client moves the session elsewhere."""
        if tokens > session.max_length:
            raise MaxLengthExceeded(f"{tokens} tokens exceed the session's max_length {session.max_length}")
        self._grow(session, tokens)

    def grow_block(self, session: Session, block: int, tokens: int) -> bool:
        """Gives `session` pages for `tokens` tokens per row in `block` (all rows or none), as an import takes them:
        from the free pages beyond what the announced prompts are still to take, out of the pages held for a drop's
        exchange first; gives False when it may not have them yet (the live exchange's copy of a lent block waits for
        room, its steps attending on the lender meanwhile)."""
        if not session.start <= block < session.end:
            raise ValueError(f"block {block} is outside session {session.session_id!r} ({session.start}:{session.end})")
        needed = kv_pages_for(tokens, self.tokens_per_page)
        missing = self._missing(session, block, needed)
        if missing == 0:
            return True
        if not self.policy.admits(pages_free=self.pool.pages_free, reserve=self.prompt_reserve(),
                                  new_session_pages=missing):
            return False
        try:
            self._check_pages_quota(session.opener, missing)
        except QuotaExceeded:
            return False
        self._take(session, block, needed, missing)
        held = self.held_for_exchange()
        if held:  # the victim's KV is what the hold was for
            self._held_for_exchange, self._hold_active_s = max(0, held - missing), self.clock()
        return True

    def _grow(self, session: Session, tokens: int) -> None:
        needed = kv_pages_for(tokens, self.tokens_per_page)
        lent = session.remote.copied if session.remote is not None else {}  # their KV grows where it is lent
        missing = {block: self._missing(session, block, needed) for block in range(session.start, session.end)
                   if block not in lent}
        total = sum(missing.values())
        if total == 0:
            return
        self._check_pages_quota(session.opener, total)
        if total > self.pool.pages_free:
            raise ServerBusy(
                f"out of KV pages: session {session.session_id!r} needs {total} more page(s) to reach {tokens} tokens "
                f"but {self.pool.pages_free} are free; continue on another server"
            )
        for block, count in missing.items():
            if count:
                self._take(session, block, needed, count)

    def _missing(self, session: Session, block: int, needed: int) -> int:
        """Gives the pages `session` lacks in `block` for `needed` pages per row."""
        return sum(max(0, needed - len(pages)) for pages in session.page_tables.get(block, [[]] * session.batch))

    def _take(self, session: Session, block: int, needed: int, count: int) -> None:
        """Takes the `count` pages that bring every row of `session`'s `block` to `needed` pages."""
        try:
            taken = list(self.pool.take(KVOwner(session.session_id, block), count))
        except OutOfPages as error:  # another owner took pages meanwhile (not on this loop today)
            raise ServerBusy(f"out of KV pages: {error.message}; continue on another server") from None
        rows = session.page_tables.setdefault(block, [[] for _ in range(session.batch)])
        for pages in rows:
            while len(pages) < needed:
                pages.append(taken.pop())

    def _check_pages_quota(self, client: str, more: int) -> None:
        """Raises QuotaExceeded if `client`'s sessions here would hold more KV pages than one client may."""
        capacity = self.pool.pages_for_kv
        cap = self.quota.page_cap(capacity) if client else None
        if cap is None or capacity - self.pool.pages_free + more <= cap:  # all KV here would fit: no count needed
            return
        held = sum(s.pages_held for s in self._sessions.values() if s.opener == client)
        if held + more > cap:
            raise QuotaExceeded(f"client {client}'s sessions would hold {held + more} KV pages on this server, more "
                                f"than the {cap} one client may ({self.quota.kv_share:.0%} of {capacity})")

    def take_blocks(self, session: Session, start: int, end: int, tokens: int) -> None:
        """Gives `session` pages for `tokens` tokens per row in blocks [start, end) outside its range (a peer's part
        of it arriving), all or none; raises ServerBusy when the pool has too few free pages."""
        per_row = kv_pages_for(tokens, self.tokens_per_page)
        total = (end - start) * session.batch * per_row
        self._check_pages_quota(session.opener, total)
        if total > self.pool.pages_free:
            raise ServerBusy(f"out of KV pages: blocks {start}:{end} of session {session.session_id!r} need {total} "
                             f"pages at {tokens} tokens, {self.pool.pages_free} are free")
        for block in range(start, end):
            taken = list(self.pool.take(KVOwner(session.session_id, block), session.batch * per_row))
            session.page_tables[block] = [taken[row * per_row:(row + 1) * per_row] for row in range(session.batch)]

    def release_blocks(self, session: Session, start: int, end: int) -> int:
        """Returns the pages of `session`'s blocks [start, end) to the pool (a part of it that left, or one that did
        not arrive) and shrinks its range if they were an end of it; gives how many. No batch may be computing with
        the session."""
        freed = 0
        for block in range(start, end):
            freed += self.pool.free(KVOwner(session.session_id, block))
            session.page_tables.pop(block, None)
        if session.start == start and end < session.end:
            session.start = end
        elif session.end == end and session.start < start:
            session.end = start
        return freed

    def make_run(self, n_pages: int) -> bool:
        """Clears a run of `n_pages` contiguous free pages (a block's parameters coming back) when enough pages are
        free but scattered, by moving the KV pages in the way to free pages elsewhere; gives whether a run that long
        is free now. Only sessions no batch computes with move: their page tables change here, on the event loop,
        which is the only writer of page tables (compute threads read those of the sessions in their batch)."""
        if self.pool.largest_free_run() >= n_pages:
            return True
        if self.pool.pages_free < n_pages:
            return False
        sessions = {**self._closing, **self._sessions}

        def movable(owner: object) -> bool:
            session = sessions.get(owner.session_id) if isinstance(owner, KVOwner) and not owner.lent else None
            return session is not None and session.in_batches == 0

        window = self.pool.clearable_window(n_pages, movable)
        if window is None:
            return False
        for page in range(*window):
            owner = self.pool.owner_of(page)
            if not isinstance(owner, KVOwner):
                continue
            moved_to = self.pool.move_page(page, outside=window)
            for pages in sessions[owner.session_id].page_tables.get(owner.block, []):
                if page in pages:
                    pages[pages.index(page)] = moved_to
        return self.pool.largest_free_run() >= n_pages

    def get(self, session_id: str) -> Session:
        """Gives the open session `session_id`; raises the error it was evicted with (for `EVICTED_TTL_S`), else
        SessionNotFound."""
        session = self._sessions.get(session_id)
        if session is None:
            evicted = self._evicted.get(session_id)
            if evicted is not None and self.clock() - evicted[0] < EVICTED_TTL_S:
                error = evicted[1]
                raise type(error)(error.message)
            raise SessionNotFound(f"session {session_id!r} is not open on this server (unknown, closed or timed out)")
        return session

    def _note_opened(self, key: str) -> None:
        self._refused.pop(key, None)
        self._opened[key] = self.clock()
        self._opened.move_to_end(key)
        while len(self._opened) > MAX_REMEMBERED:
            self._opened.popitem(last=False)

    def withdraw(self, key: str, client: str) -> bool:
        """Forgets the refused wait `key` (a `wait_id`) of `client`, which opened on another server: it no longer
        stands in line here, nor keeps the room named to it. Gives False if no such wait of that client is
        remembered."""
        wait = self._refused.get(key)
        if wait is None or wait.client != client:
            return False
        del self._refused[key]
        return True

    def opened(self, window_s: float = REFUSED_WINDOW_S) -> list[str]:
        """Gives the keys (`wait_id`s, else ids) of the sessions that opened here in the last `window_s`, oldest
        first: a segment's leader no longer counts another member's refusal of one of them as demand."""
        now = self.clock()
        while self._opened and now - next(iter(self._opened.values())) > window_s:
            self._opened.popitem(last=False)
        return list(self._opened)

    def _note_refused(self, key: str, pages: int, client: str) -> RefusedWait:
        now = self.clock()
        earlier = self._refused.get(key)
        wait = self._refused[key] = RefusedWait(now, pages, earlier.first_s if earlier is not None else now,
                                                client=client)
        self._refused.move_to_end(key)
        while len(self._refused) > MAX_REMEMBERED:
            self._refused.popitem(last=False)
        return wait

    def kv_demand_pages(self, window_s: float = REFUSED_WINDOW_S) -> int:
        """Gives the KV pages asked of this server beyond what its sessions hold: what they are expected to take as
        they grow, and what the sessions it refused for room in the last `window_s` would have taken (each session
        once, however often its client retried, until it opens here): the demand KunServe's drop trigger watches.
        A session that opened on another server meanwhile counts here until the window ends; the segment's leader
        takes it out again (`server.drop_member.refused_twice`, from the members' `opened`)."""
        return self.growth_reserve() + sum(self.refused(window_s).values())

    def refused(self, window_s: float = REFUSED_WINDOW_S) -> dict[str, int]:
        """Gives the sessions refused for room in the last `window_s` that did not open here since: id -> the pages
        each would have taken."""
        now = self.clock()
        while self._refused and now - next(iter(self._refused.values())).last_s > window_s:
            self._refused.popitem(last=False)
        return {key: wait.pages for key, wait in self._refused.items()}

    def room_in_s(self, key: str, *, pages_free: int, reserve: int, new_session_pages: int) -> float | None:
        """Gives in how many seconds a session of `new_session_pages` that was just refused (its key: a `wait_id`,
        else its id) is expected to find room here: once the waits refused before it are in, as the open sessions
        take their last steps before max_length at their step intervals (`orchestrator.admission.room_in_s`,
        `Session.steps_left`: an announced prompt counts as one step, not a step per token)."""
        running = [
            SessionPace(session.steps_left, session.step_interval_s,
                        session.pages_held, self._kv_of(session).growth_pages)
            for session in self._sessions.values()
        ]
        _, before = self._waits_before(key)
        ahead = sum(wait.pages for wait in before)
        return room_in_s(self.policy, pages_free=pages_free, reserve=reserve, new_session_pages=new_session_pages,
                         running=running, ahead_pages=ahead)

    def kept_for_named(self, key: str | None = None) -> int:
        """Gives the free pages a new session of wait `key` (a `wait_id`, else its id; None: a wait not refused here
        yet) may not take now: the room this server named to the waits refused before it, from shortly before their
        named time until their clients have had time to come back (`orchestrator.admission.pages_kept_for_named`), at
        most one client's page quota for one client's waits."""
        since, before = self._waits_before(key)
        named = [NamedWait(wait.first_s, wait.room_at_s, wait.pages, wait.client)
                 for wait in before if wait.room_at_s is not None]
        return pages_kept_for_named(named, now_s=self.clock(), since_s=since,
                                    client_cap=self.quota.page_cap(self.pool.pages_for_kv))

    def _waits_before(self, key: str | None) -> tuple[float, list[RefusedWait]]:
        """Gives when wait `key` was first refused here (now, if it was not) and the waits still remembered that were
        refused before it: its place in line."""
        self.refused()  # forgets the waits that ended
        since = self._refused[key].first_s if key is not None and key in self._refused else self.clock()
        return since, [wait for other, wait in self._refused.items() if other != key and wait.first_s < since]

    def evict(self, session_id: str, error: SwarmError) -> bool:
        """Closes a session the server can no longer serve (as `close`), and answers its later steps with `error`
        instead of SessionNotFound, so that its client knows why; gives False if it was not open."""
        session = self._sessions.get(session_id)
        if session is None:
            return False
        session.evicted = error
        self.close(session_id)
        self._evicted[session_id] = (self.clock(), error)
        self._evicted.move_to_end(session_id)
        while len(self._evicted) > MAX_REMEMBERED:
            self._evicted.popitem(last=False)
        return True

    def is_open(self, session: Session) -> bool:
        """Gives whether `session` is still open (not closed, timed out or replaced)."""
        return self._sessions.get(session.session_id) is session

    def close(self, session_id: str) -> bool:
        """Closes a session and frees its pages, or, while a batch computes with them, once that batch ends; gives
        False if it was not open."""
        session = self._sessions.pop(session_id, None)
        if session is None:
            return False
        session.closed = True
        session.last_result = None
        self._untold_parts += [(session_id, peer_id, addrs) for peer_id, addrs in session.untold]
        session.untold = []
        if session.in_batches:
            self._closing[session_id] = session
        else:
            self._free(session)
        return True

    def take_untold_parts(self) -> list[tuple[str, str, list[str]]]:
        """Gives (and forgets) the parts that closed sessions had on other servers which their clients were never
        told of (`Session.untold`): no client would step or close them there, so this server closes them."""
        parts, self._untold_parts = self._untold_parts, []
        return parts

    def enter_batch(self, session: Session) -> None:
        """Marks `session`'s pages as used by a batch about to compute."""
        session.in_batches += 1

    def leave_batch(self, session: Session) -> None:
        """Ends a batch's use of `session`'s pages; frees them if the session closed meanwhile."""
        session.in_batches -= 1
        if session.closed and session.in_batches == 0 and self._closing.pop(session.session_id, None) is not None:
            self._free(session)

    def _free(self, session: Session) -> None:
        self.pool.free_session(session.session_id)
        session.page_tables = {}

    def close_idle(self, idle_timeout_s: float) -> list[str]:
        """Closes the sessions idle for longer than `idle_timeout_s` and not running a step; gives their ids."""
        now = time.monotonic()  # as the sessions' `last_active_s`
        expired = [
            s.session_id for s in list(self._sessions.values())
            if s.running is None and now - s.last_active_s > idle_timeout_s
        ]
        return [session_id for session_id in expired if self.close(session_id)]

    def close_all(self) -> int:
        """Closes every session; gives how many were open."""
        return sum(self.close(session_id) for session_id in list(self._sessions))
