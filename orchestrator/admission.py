"""Admission of sessions to one server's KV pages, which sessions take one by one as they grow.

A session holds pages only for the tokens it has, so a server that admitted every session its free pages could
start would soon have sessions that cannot grow. The rule: each running session is expected to grow by
`headroom_tokens` more tokens (capped at its max_length) past its prompt, if its client announced one, or past what
it holds; a new session is admitted only while the free pages, less what the running sessions are expected to still
take, cover the new session's own expected pages. A session that arrives by migration is admitted on the pages it
needs now (`server.sessions.SessionTable.open`): the move chose this server for it.
The default headroom, 256 tokens, is about the mean output of the Azure LLM inference 2023 conversation trace
(211 tokens; median 129, p90 424). A running session that outgrows its expectation still takes any free page; only
when none is left does it fail (the client fails over), as a vLLM request is preempted.

Pure: counts in, counts out.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from swarm.memory import kv_pages_for

DEFAULT_HEADROOM_TOKENS = 256


@dataclass(frozen=True)
class SessionKV:
    """A running session's KV on one server: what it holds and what it is expected to grow to."""

    pages_held: int
    pages_expected: int

    @property
    def growth_pages(self) -> int:
        return max(0, self.pages_expected - self.pages_held)


@dataclass(frozen=True)
class KVPolicy:
    """The headroom rule for one server: its page geometry and how much each session is expected to grow."""

    tokens_per_page: int
    headroom_tokens: int = DEFAULT_HEADROOM_TOKENS

    def expected_pages(self, *, tokens: int, max_length: int, sequences: int) -> int:
        """Gives the pages a session is expected to hold once it grows by the headroom: `sequences` is its blocks
        on this server times its batch rows, `tokens` what it holds now."""
        grown = min(max_length, tokens + self.headroom_tokens)
        return sequences * kv_pages_for(grown, self.tokens_per_page)

    def growth_reserve(self, running: Iterable[SessionKV]) -> int:
        """Gives the free pages the running sessions are expected to still take."""
        return sum(session.growth_pages for session in running)

    def admits(self, *, pages_free: int, reserve: int, new_session_pages: int) -> bool:
        """Gives whether a new session expected to hold `new_session_pages` fits beside the running ones."""
        return pages_free - reserve >= new_session_pages

    def sessions_fit(self, *, pages_free: int, reserve: int, pages_per_session: int) -> int:
        """Gives how many more sessions of `pages_per_session` expected pages the rule would admit now."""
        return max(0, pages_free - reserve) // max(1, pages_per_session)


@dataclass(frozen=True)
class SessionPace:
    """A running session on one server: the tokens it still generates, the time between its steps (a running
    average, `averaged_interval`; None: none yet), and the pages its close gives back (those it holds, and the growth
    it no longer reserves)."""

    tokens_left: int
    step_interval_s: float | None
    pages_held: int
    growth_pages: int = 0


STEP_INTERVAL_WEIGHT = 0.25  # the weight of a session's latest step interval in its running average


def averaged_interval(average_s: float | None, interval_s: float) -> float:
    """Gives a session's running average of the time between its steps, `average_s` (None: no step yet) with
    `interval_s` added."""
    if average_s is None:
        return interval_s
    return (1 - STEP_INTERVAL_WEIGHT) * average_s + STEP_INTERVAL_WEIGHT * interval_s


def room_in_s(
    policy: KVPolicy, *, pages_free: int, reserve: int, new_session_pages: int, running: Sequence[SessionPace],
    ahead_pages: int = 0,
) -> float | None:
    """Gives in how many seconds `policy` is expected to admit a session of `new_session_pages`, once sessions that
    asked before it (`ahead_pages`, what they would take) are in: as the `running` sessions end, soonest first, each
    giving back its pages, a session ending when its tokens left have come at its step interval (one with none yet at
    the median of the others'). 0: it would now; None: no session has an interval yet, or their ends never make that
    room."""
    need = new_session_pages + ahead_pages
    if policy.admits(pages_free=pages_free, reserve=reserve, new_session_pages=need):
        return 0.0
    intervals = sorted(s.step_interval_s for s in running if s.step_interval_s is not None)
    if not intervals:
        return None
    typical_s = intervals[len(intervals) // 2]
    ends = sorted(((max(0, s.tokens_left) * (s.step_interval_s if s.step_interval_s is not None else typical_s), s)
                   for s in running), key=lambda end: end[0])
    free = pages_free
    for in_s, session in ends:
        free, reserve = free + session.pages_held, reserve - session.growth_pages
        if policy.admits(pages_free=free, reserve=reserve, new_session_pages=need):
            return in_s
    return None


# A refused wait that was named a time for room has that room kept for it from `NAMED_ROOM_LEAD_S` before the time
# (the sessions' ends come about then, not to the millisecond) until `NAMED_ROOM_GRACE_S` after it (its client's DHT
# lookup and `open` calls: 0.1-0.4 s live) [chosen: without it, clients polling on their backoff took the room a
# named wait had been promised in 40-60% of cases (r48-r53), and the longest waits grew. Room kept for a wait that
# opened elsewhere (two servers name it a time) stays idle: in the simulator on r51, r53 and r54's no-drop arms, a
# window of 1 s either side lowered the P99 TTFT 3-10% and raised the mean 8-14%; 0.3 s before and 0.6 s after, the
# P99 2-7% and the mean 4-5%]
NAMED_ROOM_LEAD_S, NAMED_ROOM_GRACE_S = 0.3, 0.6


@dataclass(frozen=True)
class NamedWait:
    """A wait a server refused for room and named a time: its place in line (when it was first refused), when the
    room was named to come (on the server's clock), the pages it would take, and its client ("": unknown)."""

    first_s: float
    room_at_s: float
    pages: int
    client: str = ""


def pages_kept_for_named(
    waits: Iterable[NamedWait], *, now_s: float, since_s: float, client_cap: int | None = None,
    window_s: tuple[float, float] = (NAMED_ROOM_LEAD_S, NAMED_ROOM_GRACE_S),
) -> int:
    """Gives the free pages a wait first refused at `since_s` (now, for a new one) may not take now: the room named
    to the waits ahead of it in line whose time is about now (`window_s`: from so long before it to so long after), at
    most `client_cap` pages for one client's waits (None: no cap), so that no client keeps a server's room by
    waiting."""
    kept: dict[str, int] = {}
    for wait in waits:
        about_now = wait.room_at_s - window_s[0] <= now_s <= wait.room_at_s + window_s[1]
        if wait.first_s < since_s and about_now:
            kept[wait.client] = kept.get(wait.client, 0) + wait.pages
    return sum(pages if client_cap is None or not client else min(pages, client_cap) for client, pages in kept.items())


BUSY_BACKOFF_FIRST_S, BUSY_BACKOFF_MAX_S = 0.5, 4.0  # a client waiting for room while every server answers busy
MIN_RETRY_S = 0.05  # the soonest a client asks again when a busy server named a time


def busy_retry_wait(backoff_s: float, soon_s: float | None) -> tuple[float, float]:
    """Gives how long a client that every server refused waits before it asks again, and its backoff after that:
    its backoff, doubling up to `BUSY_BACKOFF_MAX_S`; or, if a server named a sooner time for room (`soon_s`: pages
    a drop frees as its blocks unload, or its sessions' expected ends), that time (at least `MIN_RETRY_S`), with the
    backoff kept as it is. A named time later than the backoff does not hold the client back: a drop may make room
    before it."""
    if soon_s is None or soon_s >= backoff_s:
        return backoff_s, min(BUSY_BACKOFF_MAX_S, 2 * backoff_s)
    return max(MIN_RETRY_S, soon_s), backoff_s


DEFAULT_CLIENT_MAX_SESSIONS = 32
DEFAULT_CLIENT_KV_SHARE = 0.5


@dataclass(frozen=True)
class ClientQuota:
    """What one client peer may hold on one server, so that no client takes a whole server: open sessions (0: no
    cap), and a share of the pages that can hold KV (1.0: no cap). Sessions that reach a server by migration or a
    drop's exchange count against the client that opened them, wherever that was."""

    max_sessions: int = DEFAULT_CLIENT_MAX_SESSIONS
    kv_share: float = DEFAULT_CLIENT_KV_SHARE

    def __post_init__(self) -> None:
        if self.max_sessions < 0 or not 0.0 < self.kv_share <= 1.0:
            raise ValueError(f"a quota needs max_sessions >= 0 and 0 < kv_share <= 1, got {self}")

    def refuses_session(self, open_sessions: int) -> bool:
        """Gives whether a client with `open_sessions` here may open no more."""
        return self.max_sessions > 0 and open_sessions >= self.max_sessions

    def page_cap(self, pages_for_kv: int) -> int | None:
        """Gives the KV pages one client may hold of a server's `pages_for_kv` (None: no cap)."""
        return None if self.kv_share >= 1.0 else max(1, int(self.kv_share * pages_for_kv))
