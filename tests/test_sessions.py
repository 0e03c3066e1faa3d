"""Sessions take KV pages as they grow, are admitted by the headroom rule, and keep their pages while a batch uses
them even if they close meanwhile."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from orchestrator import admission
from orchestrator.admission import (
    BUSY_BACKOFF_MAX_S,
    NAMED_ROOM_GRACE_S,
    NAMED_ROOM_LEAD_S,
    ClientQuota,
    KVPolicy,
    NamedWait,
    SessionKV,
    SessionPace,
    pages_kept_for_named,
    room_in_s,
)
from server.sessions import REFUSED_WINDOW_S, SessionTable
from swarm.errors import (
    BlocksNotHosted,
    MaxLengthExceeded,
    QuotaExceeded,
    ServerBusy,
    SessionNotFound,
    SwarmError,
)
from swarm.memory import KVOwner, PagePool, ParamsOwner

TOKENS_PER_PAGE = 16


def table(pages: int, *, headroom_tokens: int = 16, max_length: int = 128) -> SessionTable:
    return SessionTable(
        block_start=0, block_end=4, pool=PagePool(pages * 1024, 1024), tokens_per_page=TOKENS_PER_PAGE,
        max_length=max_length, headroom_tokens=headroom_tokens,
    )


def run(scenario: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(scenario())  # sessions create asyncio futures, so they are opened inside a running loop


def test_a_session_holds_its_first_pages_and_grows_page_by_page() -> None:
    async def scenario() -> None:
        sessions = table(64)
        session = sessions.open("a", 0, 4, batch=2, max_length=128)
        assert session.pages_held == 4 * 2  # one page per block and row, nothing for max_length
        for tokens in (16, 17, 40, 100):
            sessions.grow(session, tokens)
            pages_per_sequence = -(-tokens // TOKENS_PER_PAGE)
            assert session.pages_held == 4 * 2 * pages_per_sequence  # pages for its length, no more
            for block in range(4):
                assert sorted(p for row in session.page_tables[block] for p in row) == \
                    sorted(sessions.pool.pages_of(KVOwner("a", block)))
        with pytest.raises(MaxLengthExceeded):
            sessions.grow(session, 129)
        sessions.close("a")
        assert sessions.pool.stats().pages_kv == 0
        sessions.pool.check_invariants()

    run(scenario)


def test_admission_leaves_headroom_for_running_sessions_to_grow() -> None:
    async def scenario() -> None:
        # 40 pages; a session over 4 blocks expecting 16 + 16 tokens holds 4 pages and is expected to hold 8.
        sessions = table(40, headroom_tokens=32)
        assert sessions.sessions_fit() == 5
        first = sessions.open("a", 0, 4, batch=1, max_length=128)
        assert sessions.growth_reserve() == 4  # it holds 4 and is expected to take 4 more
        assert sessions.sessions_fit() == 4  # (36 free - 4 reserved) // 8
        for name in "bcde":
            sessions.open(name, 0, 4, batch=1, max_length=128)
        assert sessions.pool.pages_free == 20 and sessions.growth_reserve() == 20 and sessions.sessions_fit() == 0
        with pytest.raises(ServerBusy, match="expected to take"):
            sessions.open("f", 0, 4, batch=1, max_length=128)  # 20 free pages, all of them the others' growth
        assert not sessions.pool.has_session("f")
        sessions.grow(first, 32)  # a running session grows into its headroom
        assert sessions.growth_reserve() == 16 and sessions.sessions_fit() == 0
        sessions.close("e")
        assert sessions.sessions_fit() == 1
        # A session that cannot grow past its max_length, or of fewer blocks, is expected to take less.
        sessions.open("short", 0, 4, batch=1, max_length=16)
        sessions.open("narrow", 3, 4, batch=1, max_length=128)
        with pytest.raises(ServerBusy):
            sessions.open("g", 0, 4, batch=1, max_length=16)
        sessions.pool.check_invariants()

    run(scenario)


def test_a_refused_session_counts_in_the_demand_once_while_its_client_may_still_wait_and_not_once_it_opened() -> None:
    async def scenario() -> None:
        sessions = table(16, headroom_tokens=0)
        holder = sessions.open("a", 0, 4, batch=2, max_length=128)  # 8 of 16 pages; "b" expects 8 and 8 more
        sessions.open("c", 0, 4, batch=1, max_length=128)
        for attempt in range(3):  # a client retrying counts once: each try is a new session of the same wait
            with pytest.raises(ServerBusy):
                sessions.open(f"b{attempt}", 0, 4, batch=3, max_length=128, wait_id="wait-b")
        assert sessions.kv_demand_pages() == 12 and sessions.opened() == ["a", "c"]
        with pytest.raises(ServerBusy):  # a client that names no wait counts by its session's id
            sessions.open("d", 0, 4, batch=2, max_length=128)
        assert sessions.kv_demand_pages() == 12 + 8
        # a client backs off up to 4 s between its attempts: it still waits for room until then
        assert REFUSED_WINDOW_S > BUSY_BACKOFF_MAX_S
        assert sessions.kv_demand_pages(window_s=0.0) == 0  # past the window it is forgotten
        with pytest.raises(ServerBusy):
            sessions.open("b3", 0, 4, batch=3, max_length=128, wait_id="wait-b")
        sessions.close(holder.session_id)
        # it holds its pages now: not a demand beside them, and the wait is named among those that opened here
        sessions.open("b4", 0, 4, batch=3, max_length=128, wait_id="wait-b")
        assert sessions.kv_demand_pages() == 0 and sessions.opened()[-1] == "wait-b"

    run(scenario)


def test_running_sessions_may_grow_past_the_headroom_until_the_pool_is_empty() -> None:
    async def scenario() -> None:
        sessions = table(12, headroom_tokens=0)
        big = sessions.open("big", 0, 4, batch=1, max_length=128)
        small = sessions.open("small", 0, 4, batch=1, max_length=128)
        sessions.grow(big, 16 * 2)
        with pytest.raises(ServerBusy, match="out of KV pages"):
            sessions.grow(big, 16 * 3)  # 4 more pages needed, none left
        assert big.pages_held == 8 and small.pages_held == 4  # nothing taken half-way
        sessions.close("small")
        sessions.grow(big, 16 * 3)
        sessions.pool.check_invariants()

    run(scenario)


def test_open_refuses_what_it_cannot_serve() -> None:
    async def scenario() -> None:
        sessions = table(64)
        with pytest.raises(BlocksNotHosted) as refused:
            sessions.open("a", 2, 5, batch=1, max_length=16)
        assert refused.value.hosted == (0, 4)  # the range it serves now, for clients routing on an older record
        received = SwarmError.from_wire(refused.value.to_wire())
        assert isinstance(received, BlocksNotHosted) and received.hosted == (0, 4)
        assert BlocksNotHosted("no range named").hosted is None
        assert BlocksNotHosted("bad", {"block_start": 5, "block_end": 2}).hosted is None
        assert BlocksNotHosted("bad", {"block_start": "0", "block_end": 4}).hosted is None
        with pytest.raises(MaxLengthExceeded):
            sessions.open("a", 0, 4, batch=1, max_length=129)
        with pytest.raises(MaxLengthExceeded):
            sessions.open("a", 0, 4, batch=65, max_length=16)
        sessions.open("a", 0, 4, batch=1, max_length=16)
        with pytest.raises(ServerBusy, match="already open"):
            sessions.open("a", 0, 4, batch=1, max_length=16)

    run(scenario)


def test_closing_while_a_batch_computes_keeps_the_pages_until_the_batch_ends() -> None:
    async def scenario() -> None:
        sessions = table(16, headroom_tokens=0)
        session = sessions.open("a", 0, 4, batch=1, max_length=64)
        pages = sessions.pool.pages_of(KVOwner("a", 0))
        sessions.enter_batch(session)
        assert sessions.close("a")
        assert sessions.pool.pages_of(KVOwner("a", 0)) == pages  # still the batch's
        with pytest.raises(ServerBusy):  # nor the same id meanwhile
            sessions.open("a", 0, 4, batch=1, max_length=64)
        with pytest.raises(SessionNotFound):
            sessions.get("a")
        sessions.leave_batch(session)
        assert not sessions.pool.has_session("a")
        sessions.pool.check_invariants()
        assert sessions.open("a", 0, 4, batch=1, max_length=64).pages_held == 4

    run(scenario)


def test_idle_expiry_skips_a_session_that_is_running_a_step() -> None:
    async def scenario() -> None:
        sessions = table(64)
        busy, idle = (sessions.open(name, 0, 4, batch=1, max_length=16) for name in ("busy", "idle"))
        busy.running = object()  # type: ignore[assignment]  # what the server sets while a step is admitted
        busy.last_active_s = idle.last_active_s = 0.0
        assert sessions.close_idle(idle_timeout_s=1.0) == ["idle"]
        assert sessions.get("busy") is busy

    run(scenario)


def test_headroom_rule_counts_growth_capped_at_max_length() -> None:
    policy = KVPolicy(tokens_per_page=16, headroom_tokens=100)
    assert policy.expected_pages(tokens=0, max_length=2048, sequences=3) == 3 * 7
    assert policy.expected_pages(tokens=0, max_length=20, sequences=3) == 3 * 2
    assert policy.expected_pages(tokens=2000, max_length=2048, sequences=1) == 128
    running = [SessionKV(pages_held=4, pages_expected=10), SessionKV(pages_held=12, pages_expected=10)]
    assert policy.growth_reserve(running) == 6  # a session past its expectation reserves nothing more
    assert policy.admits(pages_free=26, reserve=6, new_session_pages=20)
    assert not policy.admits(pages_free=25, reserve=6, new_session_pages=20)
    assert policy.sessions_fit(pages_free=5, reserve=6, pages_per_session=1) == 0


def test_a_prompt_counts_in_admission_and_a_migration_is_admitted_on_what_it_holds() -> None:
    async def scenario() -> None:
        # 40 pages over 4 blocks, headroom 16 tokens: a session announcing a 100-token prompt expects 8 pages per block
        sessions = table(40, headroom_tokens=16)
        sessions.open("long", 0, 4, batch=1, max_length=128, prompt_tokens=100)
        assert sessions.growth_reserve() == 4 * 8 - 4  # before its prompt arrives, it is expected to reach 116 tokens
        with pytest.raises(ServerBusy):  # 36 free - 28 reserved < 4 x 3 pages for a 20-token prompt + 16
            sessions.open("short", 0, 4, batch=1, max_length=128, prompt_tokens=20)
        moved = sessions.open("moved", 0, 4, batch=1, max_length=128, tokens=20, moved_in=True)
        assert moved.pages_held == 4 * 2  # 20 tokens now; the headroom of "long" does not keep it out
        with pytest.raises(ServerBusy):  # but the pages "long"'s prompt is to take do: 28 free - 4 x 6 < 4 x 2
            sessions.open("next", 0, 4, batch=1, max_length=128, tokens=20, moved_in=True)
        sessions.grow(sessions.get("long"), 100)  # its prompt arrived: 4 x 7 pages, 4 left free
        assert sessions.prompt_reserve() == 0
        sessions.close("moved")
        sessions.open("next", 0, 4, batch=1, max_length=128, tokens=20, moved_in=True)  # 12 free, 8 taken
        assert set(s.session_id for s in sessions) == {"long", "next"}
        for session_id in ("long", "next"):
            sessions.close(session_id)
        assert sessions.pool.stats().pages_kv == 0
        sessions.pool.check_invariants()

    run(scenario)


def test_pages_held_for_a_drops_exchange_keep_new_sessions_out_until_victims_took_them_or_none_came() -> None:
    """A drop holds back the pages its group-mates' victims will bring: new sessions may not take them, a victim's
    import may, and takes them out of the hold; the rest lapses once no import ran for the idle time, or at once
    when the server restores (a hold of 0)."""
    async def scenario() -> None:
        sessions = table(40, headroom_tokens=0)
        assert sessions.sessions_fit() == 10  # 4 pages each, over 4 blocks
        sessions.hold_for_exchange(24, idle_s=0.2)
        assert sessions.held_for_exchange() == 24 and sessions.sessions_fit() == 4
        for index in range(4):
            sessions.open(f"new-{index}", 0, 4, batch=1, max_length=128)
        with pytest.raises(ServerBusy, match="24 are held for the KV a drop's exchange brings"):
            sessions.open("one-more", 0, 4, batch=1, max_length=128)
        victim = sessions.open("victim", 0, 4, batch=1, max_length=128, tokens=40, moved_in=True)  # 3 pages a block
        victim.importing_from = "mate"
        assert sessions.held_for_exchange() == 12  # the victim took 12 of the 24
        await asyncio.sleep(0.3)
        assert sessions.held_for_exchange() == 12  # an import runs: the hold stays
        victim.importing_from = None
        assert sessions.held_for_exchange() == 12
        await asyncio.sleep(0.3)
        assert sessions.held_for_exchange() == 0  # no import for longer than the idle time: it lapsed
        sessions.open("one-more", 0, 4, batch=1, max_length=128)
        sessions.hold_for_exchange(8, idle_s=60.0)
        sessions.hold_for_exchange(0)  # a restore ends it
        assert sessions.held_for_exchange() == 0
        for session in list(sessions):
            sessions.close(session.session_id)
        assert sessions.pool.stats().pages_kv == 0
        sessions.pool.check_invariants()

    run(scenario)


def test_a_live_exchange_victim_opens_with_no_pages_and_takes_them_block_by_block_out_of_the_hold() -> None:
    """KunServe's live exchange: the keeper opens a victim whose KV is still lent with no pages, even with none free
    beyond the hold; each block's pages come as its KV follows, out of the pages held for the exchange, and only while
    they fit beside the announced prompts."""
    async def scenario() -> None:
        sessions = table(22, headroom_tokens=0)
        sessions.open("prompted", 0, 4, batch=1, max_length=128, prompt_tokens=48)  # 4 pages now, 8 to come
        sessions.hold_for_exchange(12, idle_s=60.0)
        victim = sessions.open("victim", 0, 4, batch=1, max_length=128, tokens=40, moved_in=True, kv_elsewhere=True)
        assert victim.pages_held == 0 and sessions.held_for_exchange() == 12
        assert sessions.grow_block(victim, 1, 40)  # 3 pages
        assert len(victim.page_tables[1][0]) == 3 and sessions.held_for_exchange() == 9
        assert sessions.grow_block(victim, 1, 40) and sessions.pool.pages_free == 15  # it has them: nothing taken
        assert sessions.grow_block(victim, 2, 40) and sessions.grow_block(victim, 3, 32)  # 3 and 2 pages
        assert sessions.pool.pages_free == 10 and not sessions.grow_block(victim, 0, 40)  # the prompt's 8 stay free
        assert victim.page_tables.keys() == {1, 2, 3} and sessions.held_for_exchange() == 4
        for session in list(sessions):
            sessions.close(session.session_id)
        assert sessions.pool.pages_free == 22
        sessions.pool.check_invariants()

    run(scenario)


def test_a_lent_victim_opens_on_a_full_pool_where_a_victim_bringing_its_kv_waits() -> None:
    """Right after a drop both members' pools can be full, their dropped blocks' pages freed only once their own
    victims stop using them. A victim lent to the keeper takes no page now, so it opens however few are free (else
    each member waits on the other's victims and the freed pages come only as sessions end); one bringing its KV
    still waits for room."""
    async def scenario() -> None:
        sessions = table(12, headroom_tokens=0)
        prompted = sessions.open("prompted", 0, 4, batch=1, max_length=128, prompt_tokens=48)  # 4 pages, 8 to come
        sessions.pool.allocate(ParamsOwner(7), 8)  # as a block's parameters the server's own victims still use
        assert sessions.pool.pages_free == 0
        with pytest.raises(ServerBusy):
            sessions.open("moved", 0, 4, batch=1, max_length=128, tokens=16, moved_in=True)
        victim = sessions.open("lent", 0, 4, batch=1, max_length=128, tokens=40, moved_in=True, kv_elsewhere=True)
        assert victim.pages_held == 0 and not sessions.grow_block(victim, 0, 40)  # its KV stays lent meanwhile
        sessions.pool.free(ParamsOwner(7))
        assert not sessions.grow_block(victim, 0, 40)  # the 8 freed are the announced prompt's
        sessions.grow(prompted, 48)
        sessions.close("prompted")
        assert sessions.grow_block(victim, 0, 40) and victim.pages_held == 3
        sessions.close("lent")
        assert sessions.pool.pages_free == 12
        sessions.pool.check_invariants()

    run(scenario)


def test_a_run_is_cleared_by_moving_kv_pages_that_keep_their_bytes_and_page_tables() -> None:
    async def scenario() -> None:
        sessions = table(32)  # KV pages are taken from the top: a..g hold pages 31..4 in fours, 0..3 are free
        for name in "abcdefg":
            sessions.open(name, 0, 4, batch=1, max_length=128)
        for name in "aceg":
            sessions.close(name)
        pool = sessions.pool
        assert (pool.pages_free, pool.largest_free_run()) == (20, 8)
        contents = {}
        for name in "bdf":
            for block, rows in sessions.get(name).page_tables.items():
                for page in rows[0]:
                    pool.storage[page * 1024:(page + 1) * 1024].fill_(page % 251)
                    contents[name, block] = page % 251
        sessions.get("b").in_batches = 1  # a batch computes with b: its pages stay where they are

        assert sessions.make_run(12)
        assert pool.largest_free_run() >= 12 and pool.pages_free == 20
        for (name, block), value in contents.items():
            (page,) = sessions.get(name).page_tables[block][0]
            assert pool.owner_of(page) == KVOwner(name, block)
            assert bool((pool.storage[page * 1024:(page + 1) * 1024] == value).all())
        assert sorted(sessions.get("b").page_tables[block][0][0] for block in range(4)) == [24, 25, 26, 27]
        assert not sessions.make_run(21)  # more than is free
        pool.check_invariants()

    run(scenario)


@given(closed=st.lists(st.booleans(), min_size=1, max_size=7), busy=st.integers(0, 6), length=st.integers(1, 32))
def test_clearing_a_run_either_refuses_or_keeps_every_kv_byte_where_its_page_table_says(
    closed: list[bool], busy: int, length: int
) -> None:
    async def scenario() -> None:
        sessions = table(32)
        names = [f"s{index}" for index in range(len(closed))]
        for name in names:
            sessions.open(name, 0, 4, batch=1, max_length=128)
        for name, close in zip(names, closed, strict=True):
            if close:
                sessions.close(name)
        pool = sessions.pool
        open_names = [name for name, close in zip(names, closed, strict=True) if not close]
        if open_names:
            sessions.get(open_names[busy % len(open_names)]).in_batches = 1
        expected = {}
        for name in open_names:
            for block, rows in sessions.get(name).page_tables.items():
                (page,) = rows[0]
                pool.storage[page * 1024:(page + 1) * 1024].fill_(1 + page % 250)
                expected[name, block] = 1 + page % 250
        free_before = pool.pages_free

        cleared = sessions.make_run(length)
        assert cleared == (pool.largest_free_run() >= length)
        assert pool.pages_free == free_before
        for (name, block), value in expected.items():
            (page,) = sessions.get(name).page_tables[block][0]
            assert pool.owner_of(page) == KVOwner(name, block)
            assert bool((pool.storage[page * 1024:(page + 1) * 1024] == value).all())
        pool.check_invariants()

    run(scenario)


def test_a_client_over_its_quota_is_refused_with_a_typed_busy_error_and_other_clients_are_not() -> None:
    async def scenario() -> None:
        sessions = SessionTable(
            block_start=0, block_end=4, pool=PagePool(64 * 1024, 1024), tokens_per_page=TOKENS_PER_PAGE,
            max_length=128, headroom_tokens=0, quota=ClientQuota(max_sessions=2, kv_share=0.25),
        )
        first = sessions.open("a1", 0, 4, batch=1, max_length=128, opener="alice")
        sessions.open("a2", 0, 4, batch=1, max_length=128, opener="alice")
        with pytest.raises(QuotaExceeded, match="2 sessions") as refused:
            sessions.open("a3", 0, 4, batch=1, max_length=128, opener="alice")
        assert isinstance(refused.value, ServerBusy)  # routed around as a full server is
        # alice holds 8 of the 16 pages she may (a quarter of 64); growing by 9 more would pass the cap
        sessions.grow(first, 2 * TOKENS_PER_PAGE)  # 4 more pages: 12
        with pytest.raises(QuotaExceeded, match="16 one client may"):
            sessions.grow(first, 4 * TOKENS_PER_PAGE)  # 8 more: 20 > 16
        assert first.pages_held == 8 and sessions.is_open(first)  # nothing taken, the session is whole
        bob = sessions.open("b1", 0, 4, batch=1, max_length=128, opener="bob")  # another client: unaffected
        sessions.grow(bob, 4 * TOKENS_PER_PAGE)
        assert bob.pages_held == 16
        sessions.close("a2")
        sessions.open("a3", 0, 4, batch=1, max_length=128, opener="alice")  # room again
        sessions.pool.check_invariants()

    run(scenario)


def test_a_quota_needs_a_share_in_0_to_1_and_no_negative_session_cap() -> None:
    for bad in ({"max_sessions": -1}, {"kv_share": 0.0}, {"kv_share": 1.5}):
        with pytest.raises(ValueError):
            ClientQuota(**bad)
    assert ClientQuota(max_sessions=0, kv_share=1.0).page_cap(100) is None
    assert not ClientQuota(max_sessions=0).refuses_session(10_000)


def test_room_comes_as_the_soonest_ending_sessions_give_back_their_pages_after_the_waits_before() -> None:
    policy = KVPolicy(TOKENS_PER_PAGE)
    # ending in 3 s (30 tokens at 0.1 s), 1 s and 2 s (the median interval of the others, 0.1 s, for 20 tokens)
    running = [SessionPace(30, 0.1, 4, 2), SessionPace(10, 0.1, 2), SessionPace(20, None, 3)]
    assert room_in_s(policy, pages_free=5, reserve=0, new_session_pages=5, running=running) == 0.0
    # 2 free beside 4 reserved: the first end (1 s) frees 2, the second (2 s) 3 more: 7 - 4 >= 3
    assert room_in_s(policy, pages_free=2, reserve=4, new_session_pages=3, running=running) == pytest.approx(2.0)
    # a wait before it asks 3 pages: the third end (3 s) gives back 4 held pages and its 2 reserved
    assert room_in_s(policy, pages_free=2, reserve=4, new_session_pages=3, running=running,
                     ahead_pages=3) == pytest.approx(3.0)
    assert room_in_s(policy, pages_free=2, reserve=4, new_session_pages=20, running=running) is None
    assert room_in_s(policy, pages_free=0, reserve=0, new_session_pages=1, running=[]) is None
    # no session has stepped twice: no time to name; one past its max_length ends any moment
    assert room_in_s(policy, pages_free=0, reserve=0, new_session_pages=2, running=[SessionPace(5, None, 2)]) is None
    assert room_in_s(policy, pages_free=0, reserve=0, new_session_pages=2, running=[SessionPace(-3, 0.1, 2)]) == 0.0
    assert admission.averaged_interval(None, 0.4) == 0.4
    assert admission.averaged_interval(0.4, 0.8) == pytest.approx(0.5)


@given(st.lists(st.tuples(st.integers(-2, 60), st.none() | st.floats(0.0, 1.0), st.integers(0, 8), st.integers(0, 4)),
                max_size=8),
       st.integers(0, 16), st.integers(0, 16), st.integers(1, 16), st.integers(0, 16))
def test_room_never_comes_sooner_for_a_wait_with_more_waits_before_it(
    paces: list[tuple[int, float | None, int, int]], free: int, reserve: int, need: int, ahead: int
) -> None:
    policy, running = KVPolicy(TOKENS_PER_PAGE), [SessionPace(*pace) for pace in paces]
    first = room_in_s(policy, pages_free=free, reserve=reserve, new_session_pages=need, running=running)
    later = room_in_s(policy, pages_free=free, reserve=reserve, new_session_pages=need, running=running,
                      ahead_pages=ahead)
    if later is not None:
        assert first is not None and 0.0 <= first <= later


def test_a_session_is_expected_to_take_its_prompt_as_one_step_and_to_stop_one_token_short_of_max_length() -> None:
    async def scenario() -> None:
        sessions = table(64)
        # generate(max_new_tokens=5) on a 12-token prompt: max_length 17, the prompt's step, then 4 decode steps (the
        # 5th token is generated by the last of them and never fed back)
        session = sessions.open("a", 0, 4, batch=1, max_length=17, prompt_tokens=12)
        assert session.steps_left == 5
        for position, left in ((12, 4), (13, 3), (16, 0)):
            session.position = position
            assert session.steps_left == left
        unannounced = sessions.open("b", 0, 4, batch=1, max_length=17)  # no prompt said: a step a token, at most
        assert unannounced.steps_left == 16
        sessions.close_all()

    run(scenario)


def test_a_full_server_names_when_its_sessions_ends_make_room_and_a_later_wait_a_later_time() -> None:
    async def scenario() -> None:
        sessions = table(16, headroom_tokens=0)
        # two sessions of 4 blocks x 2 rows (8 pages each) fill the pool: "a" has 20 steps to go, "b" 60 (a client's
        # last token is never fed back: a session of max_length 31 at position 10 takes 20 more steps)
        a = sessions.open("a", 0, 4, batch=2, max_length=31)
        b = sessions.open("b", 0, 4, batch=2, max_length=71)
        for session in (a, b):
            session.position = 10
        with pytest.raises(ServerBusy) as unknown:
            sessions.open("c", 0, 4, batch=2, max_length=30, wait_id="wait-c")
        assert unknown.value.retry_after_s is None  # no session has stepped twice: no time to name
        for session, interval_s in ((a, 0.1), (b, 0.05)):
            session.note_committed(10, 100.0)  # a prompt: no interval yet
            session.note_committed(1, 100.0 + interval_s)
        assert a.step_interval_s == pytest.approx(0.1) and b.step_interval_s == pytest.approx(0.05)
        with pytest.raises(ServerBusy, match="expected to make room") as first:
            sessions.open("c2", 0, 4, batch=2, max_length=30, wait_id="wait-c")
        assert first.value.retry_after_s == pytest.approx(2.0)  # "a": 20 steps at 0.1 s
        with pytest.raises(ServerBusy) as second:
            sessions.open("d", 0, 4, batch=2, max_length=30, wait_id="wait-d")
        assert second.value.retry_after_s == pytest.approx(3.0)  # after "c": "b" too, 60 steps at 0.05 s
        with pytest.raises(ServerBusy) as again:  # the first wait asks again: still first in line
            sessions.open("c3", 0, 4, batch=2, max_length=30, wait_id="wait-c")
        assert again.value.retry_after_s == pytest.approx(2.0)
        sessions.close("a")
        sessions.open("c4", 0, 4, batch=2, max_length=30, wait_id="wait-c")
        with pytest.raises(ServerBusy) as after:  # "c" is in: "d" is first now, and "c" has no interval yet
            sessions.open("d2", 0, 4, batch=2, max_length=30, wait_id="wait-d")
        assert after.value.retry_after_s == pytest.approx(1.45)  # "c" at the median ("b"'s): 29 steps at 0.05 s
        sessions.close("c4")
        # a session that announced its prompt has that many tokens fewer to go: its prompt is one step
        sessions.open("e", 0, 4, batch=2, max_length=22, prompt_tokens=12)
        with pytest.raises(ServerBusy) as prompted:
            sessions.open("d3", 0, 4, batch=2, max_length=30, wait_id="wait-d")
        assert prompted.value.retry_after_s == pytest.approx(0.5)  # "e": its prompt, then 9 steps, at 0.05 s
        sessions.pool.check_invariants()

    run(scenario)


def test_the_room_named_to_a_wait_is_kept_from_later_waits_about_its_time_and_one_clients_keep_is_capped() -> None:
    first = NamedWait(first_s=10.0, room_at_s=20.0, pages=4, client="alice")
    second = NamedWait(first_s=11.0, room_at_s=25.0, pages=3, client="bob")
    waits = [first, second]
    # a new wait (first refused now) is behind both; only the one whose named time is about now keeps its room
    assert pages_kept_for_named(waits, now_s=20.0, since_s=20.0) == 4
    assert pages_kept_for_named(waits, now_s=20.0 - NAMED_ROOM_LEAD_S, since_s=30.0) == 4
    assert pages_kept_for_named(waits, now_s=20.0 - NAMED_ROOM_LEAD_S - 0.01, since_s=30.0) == 0  # room came early
    assert pages_kept_for_named(waits, now_s=20.0 + NAMED_ROOM_GRACE_S + 0.01, since_s=30.0) == 0  # it did not come
    assert pages_kept_for_named(waits, now_s=25.0 - NAMED_ROOM_LEAD_S, since_s=30.0) == 3
    # a wait ahead of them in line has nothing kept from it; the second has only the first's
    assert pages_kept_for_named(waits, now_s=20.0, since_s=10.0) == 0
    assert pages_kept_for_named([first, dataclasses.replace(second, room_at_s=20.5)], now_s=20.0, since_s=11.0) == 4
    # one client's waits keep at most its cap; waits of unknown clients are not capped together
    many = [NamedWait(first_s=float(i), room_at_s=20.0, pages=4, client="alice") for i in range(5)]
    assert pages_kept_for_named(many, now_s=20.0, since_s=30.0, client_cap=6) == 6
    assert pages_kept_for_named([*many, second], now_s=25.0, since_s=30.0, client_cap=6) == 3
    anonymous = [dataclasses.replace(wait, client="") for wait in many]
    assert pages_kept_for_named(anonymous, now_s=20.0, since_s=30.0, client_cap=6) == 20


def full_table_c_waiting(now: list[float]) -> SessionTable:
    """A table of 16 pages on the clock `now[0]`, filled by two sessions of 4 blocks x 2 rows 10 tokens in, stepping
    every 0.1 s: "a" ends in 2 s (20 steps to go), "b" in 6 s (60); then a wait "wait-c" of client "alice" was refused
    and named a's end."""
    sessions = SessionTable(block_start=0, block_end=4, pool=PagePool(16 * 1024, 1024), tokens_per_page=TOKENS_PER_PAGE,
                            max_length=128, headroom_tokens=0, clock=lambda: now[0])
    for session_id, max_length in (("a", 31), ("b", 71)):
        session = sessions.open(session_id, 0, 4, batch=2, max_length=max_length)
        session.position = 10
        session.note_committed(10, 50.0)
        session.note_committed(1, 50.1)
    with pytest.raises(ServerBusy) as named:
        sessions.open("c", 0, 4, batch=2, max_length=30, wait_id="wait-c", opener="alice")
    assert named.value.retry_after_s == pytest.approx(2.0)
    return sessions


def test_a_full_server_keeps_the_room_it_named_for_the_first_wait_until_its_client_is_back_or_late() -> None:
    async def scenario() -> None:
        now = [100.0]
        sessions = full_table_c_waiting(now)
        now[0] += 1.9
        sessions.close("a")  # its room comes a little before the named time
        with pytest.raises(ServerBusy, match="kept for waits refused before it") as later:
            sessions.open("d", 0, 4, batch=2, max_length=30, wait_id="wait-d", opener="bob")
        assert later.value.retry_after_s is not None  # d is told when room comes for it, after c
        now[0] += 0.4  # c's client is back after its lookup: the room is there
        sessions.open("c2", 0, 4, batch=2, max_length=30, wait_id="wait-c", opener="alice")
        sessions.close("c2")
        # d is first in line now; its room is there
        sessions.open("d2", 0, 4, batch=2, max_length=30, wait_id="wait-d", opener="bob")
        # a wait whose client opened elsewhere keeps its named room only until its grace has passed
        with pytest.raises(ServerBusy) as other:  # d2 has no interval yet: at b's, 29 steps at 0.1 s
            sessions.open("f", 0, 4, batch=2, max_length=30, wait_id="wait-f", opener="carol")
        assert other.value.retry_after_s == pytest.approx(2.9)
        room_at = now[0] + 2.9
        sessions.close("d2")
        now[0] = room_at
        with pytest.raises(ServerBusy, match="kept for waits"):
            sessions.open("g", 0, 4, batch=2, max_length=30, wait_id="wait-g", opener="dave")
        now[0] = room_at + NAMED_ROOM_GRACE_S + 0.01
        sessions.open("g2", 0, 4, batch=2, max_length=30, wait_id="wait-g", opener="dave")
        sessions.pool.check_invariants()

    run(scenario)


def test_a_wait_withdrawn_by_its_client_leaves_the_line_and_its_kept_room_at_once() -> None:
    async def scenario() -> None:
        now = [100.0]
        sessions = full_table_c_waiting(now)
        now[0] += 0.1
        with pytest.raises(ServerBusy) as behind:
            sessions.open("d", 0, 4, batch=2, max_length=30, wait_id="wait-d", opener="bob")
        assert behind.value.retry_after_s == pytest.approx(6.0)  # after c: b's end
        assert sessions.kv_demand_pages() == 16
        # only the client that waited may withdraw its wait, and an unknown wait is no error
        assert not sessions.withdraw("wait-c", "bob") and not sessions.withdraw("wait-x", "alice")
        assert sessions.withdraw("wait-c", "alice")  # c opened on another server
        assert sessions.refused() == {"wait-d": 8} and sessions.kv_demand_pages() == 8
        with pytest.raises(ServerBusy) as first:  # d is first in line now: a's end is its room
            sessions.open("d2", 0, 4, batch=2, max_length=30, wait_id="wait-d", opener="bob")
        assert first.value.retry_after_s == pytest.approx(2.0)
        # the room named to c is no longer kept from d (kept, it would be until c's grace had passed)
        now[0] += 1.9
        sessions.close("a")
        sessions.open("d3", 0, 4, batch=2, max_length=30, wait_id="wait-d", opener="bob")
        sessions.pool.check_invariants()

    run(scenario)
