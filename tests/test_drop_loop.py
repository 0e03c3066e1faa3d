"""KunServe's loop over a segment (orchestrator/buddy/segment_loop), driven by records a test writes: the leader
drops when the segment's demand outgrows its KV pages, aborts a plan a member refuses, restores once the drop is old
enough and the demand fits; the other members do nothing."""

from __future__ import annotations

import asyncio

from orchestrator.buddy.segment_loop import REFUSED_PLAN_S, DropLoop, drop_group, segment_of
from orchestrator.service.dropping import FollowerDropping
from server.drop_member import opened_digests, refused_digests, refused_twice
from swarm.errors import ServerBusy
from swarm.records import ServerRecord
from tests.test_records import make_wire

PAGES_TOTAL, PARAMS_PER_BLOCK = 100, 5


def record(peer: str, start: int, end: int, *, kv: int, demand: int = 0, packed: int = 0,
           restorable: tuple[int, int] | None = None, reshaping: bool = False, dropping: bool = True) -> ServerRecord:
    params = PARAMS_PER_BLOCK * (end - start)
    parsed = ServerRecord.from_wire(make_wire(
        peer_id=peer, block_start=start, block_end=end, pages_total=PAGES_TOTAL, pages_params=params, pages_kv=kv,
        pages_free=PAGES_TOTAL - params - kv, kv_demand_pages=demand, kv_packed_pages=packed,
        restorable_start=restorable[0] if restorable else None, restorable_end=restorable[1] if restorable else None,
        reshaping=reshaping, segment_dropping=dropping,
    ))
    assert parsed is not None
    return parsed


class Segment:
    """The records the loop reads, and what it asked of whom."""

    def __init__(self, records: list[ServerRecord], refuse: frozenset[str] = frozenset()) -> None:
        self.records = records
        self.refuse = refuse
        self.calls: list[tuple[str, ...]] = []
        self.whole: set[str] = set()  # members that serve their whole segment, whatever their records say
        self.reserves: dict[str, int] = {}  # the pages each member was told to hold back for the exchange

    async def group(self) -> list[ServerRecord]:
        return list(self.records)

    async def drop(self, peer: str, start: int, end: int, reserve: int) -> None:
        self.calls.append(("drop", peer, f"{start}:{end}"))
        self.reserves[peer] = reserve
        if peer in self.refuse:
            raise ServerBusy(f"{peer} refuses")

    async def restore(self, peer: str, evict_merged: bool) -> bool:
        self.calls.append(("restore", peer, "evict") if evict_merged else ("restore", peer))
        return peer not in self.whole  # whether it had dropped blocks to load back

    def loop(self, peer: str, calm_s: float = 15.0) -> DropLoop:
        return DropLoop(peer, group=self.group, drop=self.drop, restore=self.restore, restore_after_s=10.0,
                        restore_calm_s=calm_s)


def test_the_leader_drops_on_a_burst_and_restores_once_the_drop_is_old_and_the_demand_has_fitted_for_a_while() -> None:
    async def body() -> None:
        segment = Segment([record("a", 0, 8, kv=20), record("b", 0, 8, kv=20)])
        leader, member = segment.loop("a"), segment.loop("b")
        for now in (0.0, 0.5):
            await leader.tick(now)
            await member.tick(now)
            assert segment.calls == []  # 40 of 120 KV pages in use, steady
        segment.records = [record("a", 0, 8, kv=50, demand=20), record("b", 0, 8, kv=50, demand=20)]
        await member.tick(1.0)
        assert segment.calls == []  # not the leader
        await leader.tick(1.0)  # demand 140 and rising against 120 pages: a pair, half the blocks each
        assert segment.calls == [("drop", "b", "4:8"), ("drop", "a", "0:4")]  # the leader's own last
        assert leader.drops == 1 and leader.last_plan is not None and leader.last_plan.total_freed_pages == 40
        assert segment.reserves == {"a": 25, "b": 25}  # each holds back the half of its mate's 50 KV pages it keeps

        segment.calls.clear()
        segment.records = [record("a", 0, 4, kv=10, restorable=(0, 8)), record("b", 4, 8, kv=10, restorable=(0, 8))]
        for now in (1.5, 5.0, 10.5):
            await leader.tick(now)
        assert segment.calls == []  # demand fits, but the drop is not 10 s old
        await leader.tick(11.5)
        assert segment.calls == []  # the drop is old enough, but the burst's demand (t = 1.0) is not 15 s old
        await leader.tick(16.5)
        assert segment.calls == [("restore", "a"), ("restore", "b")]
        assert leader.restores == 1 and leader.dropped_since_s is None

    asyncio.run(body())


def test_a_drop_holds_pages_for_the_announced_prompts_of_sessions_that_opened_but_took_no_step_yet() -> None:
    async def body() -> None:
        # a holds 20 KV pages and two fresh sessions whose prompts take 16 more; b's sessions all opened just now
        segment = Segment([record("a", 0, 8, kv=20, packed=36), record("b", 0, 8, kv=0, packed=32)])
        leader = segment.loop("a")
        await leader.tick(0.0)
        segment.records = [record("a", 0, 8, kv=20, demand=70, packed=36),
                           record("b", 0, 8, kv=0, demand=70, packed=32)]
        await leader.tick(0.5)
        assert segment.calls == [("drop", "b", "4:8"), ("drop", "a", "0:4")]  # the leader's own last
        assert segment.reserves == {"a": 16, "b": 18}  # half of the mate's packed pages, not of its 0 or 20 KV pages

    asyncio.run(body())


def test_a_record_that_lags_behind_a_restore_asks_again_but_counts_no_second_restore() -> None:
    async def body() -> None:
        dropped = [record("a", 0, 4, kv=10, restorable=(0, 8)), record("b", 4, 8, kv=10, restorable=(0, 8))]
        segment = Segment(dropped)
        leader = segment.loop("a", calm_s=0.0)
        await leader.tick(0.0)
        await leader.tick(10.5)  # the drop is 10 s old and the demand fits
        assert segment.calls == [("restore", "a"), ("restore", "b")] and leader.restores == 1
        segment.calls.clear()
        segment.whole = {"a", "b"}
        segment.records = [record("a", 0, 8, kv=10), dropped[1]]  # b's record still shows its drop
        for now in (11.0, 21.5):
            await leader.tick(now)
        assert segment.calls == [("restore", "b")]  # asked again: b had nothing left to load
        assert leader.restores == 1 and leader.dropped_since_s is None and leader.dropped_peers == set()

    asyncio.run(body())


def test_members_loading_their_blocks_lower_the_available_pages_in_a_step_that_asks_for_no_drop() -> None:
    async def body() -> None:
        # servers that were just assigned 0:8 and load its parameters: no session, no demand
        loading = [record("a", 0, 8, kv=0).model_copy(update={"pages_params": 0}),
                   record("b", 0, 8, kv=0).model_copy(update={"pages_params": 0})]
        segment = Segment(loading)
        leader = segment.loop("a")
        await leader.tick(0.0)
        segment.records = [record("a", 0, 8, kv=0), record("b", 0, 8, kv=0)]  # 200 KV pages became 120
        await leader.tick(0.25)  # as a rate: -320 pages a second, below the demand within the horizon
        await leader.tick(0.5)
        assert segment.calls == [] and leader.drops == 0
        assert leader.available == [(0.25, 120), (0.5, 120)]

    asyncio.run(body())


def test_an_orchestrators_loop_keeps_what_it_did_while_a_followers_record_lags() -> None:
    async def body() -> None:
        calls: list[tuple[str, str]] = []

        async def fresh(found: ServerRecord) -> ServerRecord:
            return found

        async def call(found: ServerRecord, method: str, payload: dict[str, object]) -> object:
            calls.append((method, found.peer_id))
            return {"restored": True}

        dropping = FollowerDropping("orchestrator", fresh=fresh, call=call, queued_tokens=lambda: 0, period_s=0.25,
                                    restore_after_s=10.0, restore_calm_s=0.0)
        steady = {"a": record("a", 0, 8, kv=20), "b": record("b", 0, 8, kv=20)}
        await dropping.tick(steady, 0.0)
        assert await dropping.tick({"a": record("a", 0, 8, kv=50, demand=20),
                                    "b": record("b", 0, 8, kv=50, demand=20)}, 1.0)
        assert calls == [("drop", "a"), ("drop", "b")]
        # b's record is off for a moment (one from before its range was assigned, say): another segment
        await dropping.tick({"a": record("a", 0, 4, kv=10, restorable=(0, 8)), "b": record("b", 4, 8, kv=0)}, 1.5)
        assert dropping.to_wire() == {}  # no segment two followers share now
        dropped = {"a": record("a", 0, 4, kv=10, restorable=(0, 8)), "b": record("b", 4, 8, kv=10, restorable=(0, 8))}
        await dropping.tick(dropped, 2.0)
        (loop,) = dropping.to_wire().values()
        assert loop["drops"] == 1 and loop["dropped"]  # the same loop: the drop is still its own
        assert await dropping.tick(dropped, 12.0)  # 11 s after the drop, the demand fits
        assert calls[2:] == [("restore", "a"), ("restore", "b")]
        (loop,) = dropping.to_wire().values()
        assert (loop["drops"], loop["restores"], loop["dropped"]) == (1, 1, False)

    asyncio.run(body())


def test_a_member_that_refuses_the_plan_aborts_it_and_the_members_that_dropped_restore() -> None:
    async def body() -> None:
        members = ("a", "b", "c")
        segment = Segment([record(peer, 0, 8, kv=20) for peer in members], refuse=frozenset({"c"}))
        leader = segment.loop("a")
        await leader.tick(0.0)
        segment.records = [record(peer, 0, 8, kv=50, demand=40) for peer in members]
        await leader.tick(0.5)
        # the leader's own drop comes last: b dropped before c refused, and b restores
        assert segment.calls == [("drop", "b", "3:6"), ("drop", "c", "6:8"), ("restore", "b")]
        assert (leader.drops, leader.aborts) == (0, 1)

    asyncio.run(body())


def test_the_leaders_plans_leave_a_member_that_refused_out_for_a_while_then_ask_it_again() -> None:
    async def body() -> None:
        segment = Segment([record("a", 0, 8, kv=20), record("b", 0, 8, kv=20)], refuse=frozenset({"b"}))
        leader = segment.loop("a")
        await leader.tick(0.0)
        segment.records = [record("a", 0, 8, kv=50, demand=20), record("b", 0, 8, kv=50, demand=20)]
        await leader.tick(0.5)
        assert segment.calls == [("drop", "b", "4:8")]  # refused before the leader dropped: nothing to undo
        for tick in range(1, 2 * round(REFUSED_PLAN_S)):  # the burst goes on: no plan, since one server alone
            segment.records = [record(peer, 0, 8, kv=50, demand=20 + tick) for peer in ("a", "b")]
            await leader.tick(0.5 + tick * 0.5)  # keeps every block
        assert segment.calls == [("drop", "b", "4:8")] and leader.aborts == 1
        segment.refuse = frozenset()
        segment.records = [record(peer, 0, 8, kv=50, demand=60) for peer in ("a", "b")]
        await leader.tick(0.5 + REFUSED_PLAN_S)
        assert segment.calls[1:] == [("drop", "b", "4:8"), ("drop", "a", "0:4")] and leader.drops == 1

    asyncio.run(body())


def test_a_server_of_the_segment_that_takes_no_part_in_its_drops_neither_leads_nor_is_planned_for() -> None:
    bystander = record("a", 0, 8, kv=0, dropping=False)  # the smallest peer id: it would lead
    members = {"a": bystander, "b": record("b", 0, 8, kv=0), "c": record("c", 0, 8, kv=0)}
    assert [r.peer_id for r in drop_group(members, (0, 8))] == ["b", "c"]

    async def body() -> None:
        segment = Segment([members["b"], members["c"]])
        leader = segment.loop("b")
        await leader.tick(0.0)
        segment.records = [record(peer, 0, 8, kv=50, demand=20) for peer in ("b", "c")]
        await leader.tick(0.5)
        assert segment.calls == [("drop", "c", "4:8"), ("drop", "b", "0:4")] and leader.drops == 1

    asyncio.run(body())


def test_a_dropped_server_stays_in_the_segment_it_can_restore() -> None:
    dropped = record("a", 0, 4, kv=0, restorable=(0, 8))
    whole = record("b", 0, 8, kv=0)
    other = record("c", 8, 16, kv=0)
    assert segment_of(dropped) == segment_of(whole) == (0, 8)
    assert [r.peer_id for r in drop_group({"a": dropped, "b": whole, "c": other}, (0, 8))] == ["a", "b"]


def test_a_member_that_leaves_while_dropped_makes_the_others_restore_at_once() -> None:
    async def body() -> None:
        segment = Segment([record("a", 0, 8, kv=20), record("b", 0, 8, kv=20)])
        leader = segment.loop("a")
        await leader.tick(0.0)
        segment.records = [record("a", 0, 8, kv=50, demand=20), record("b", 0, 8, kv=50, demand=20)]
        await leader.tick(0.5)
        segment.calls.clear()
        segment.records = [record("a", 0, 4, kv=50, demand=20, restorable=(0, 8))]  # b, keeping 4:8, is gone
        await leader.tick(1.0)  # busy, and the drop is young: only the lost blocks make it restore
        assert segment.calls == [("restore", "a", "evict")] and leader.restores == 1

    asyncio.run(body())


def test_a_burst_that_outgrows_the_first_plan_merges_the_servers_still_whole() -> None:
    async def body() -> None:
        segment = Segment([record(peer, 0, 8, kv=20) for peer in "abcd"])
        leader = segment.loop("a", calm_s=0.0)
        await leader.tick(0.0)
        segment.records = [record(peer, 0, 8, kv=35) for peer in "abcd"]
        await leader.tick(0.5)  # demand 140 rising 120/s against 240 pages: 20 short, and a pair frees 40
        assert segment.calls == [("drop", "b", "4:8"), ("drop", "a", "0:4")]  # the leader's own last
        segment.calls.clear()
        # the DHT still shows a and b whole, and the demand holds: nothing to do
        segment.records = [record(peer, 0, 8, kv=35) for peer in "abcd"]
        await leader.tick(1.0)
        assert segment.calls == []
        # the burst rises again: 200 and 120/s against 240 (still the stale view), 40 short. The loop remembers
        # that it told a and b to drop and pairs the two servers still whole
        segment.records = [record(peer, 0, 8, kv=50) for peer in "abcd"]
        await leader.tick(1.5)
        assert segment.calls == [("drop", "c", "0:4"), ("drop", "d", "4:8")]
        assert leader.drops == 2 and leader.dropped_peers == {"a", "b", "c", "d"}

        segment.calls.clear()
        segment.records = [record(peer, start, start + 4, kv=5, restorable=(0, 8))
                           for peer, start in (("a", 0), ("b", 4), ("c", 0), ("d", 4))]
        await leader.tick(2.0)
        await leader.tick(12.0)  # the demand fits, 10 s after the second drop: every dropped block comes back
        assert segment.calls == [("restore", peer) for peer in "abcd"]
        assert leader.restores == 1 and leader.dropped_peers == set()

    asyncio.run(body())


def test_once_no_two_servers_are_whole_a_deeper_burst_merges_the_pairs_into_a_group_of_four() -> None:
    async def body() -> None:
        pairs = [("a", 0), ("b", 4), ("c", 0), ("d", 4)]

        def records(kv: int, *, c_lags: bool = False) -> list[ServerRecord]:
            return [record(peer, 0, 8, kv=kv - 20) if c_lags and peer == "c" else
                    record(peer, start, start + 4, kv=kv, restorable=(0, 8)) for peer, start in pairs]

        segment = Segment(records(60, c_lags=True))
        leader = segment.loop("a")
        leader.dropped_peers.update("abcd")  # it told all four to drop; c's record does not show it yet
        leader.dropped_since_s = 0.0
        await leader.tick(0.0)
        segment.records = records(75, c_lags=True)
        await leader.tick(0.5)  # the demand rises, but c looks whole, which it is not: nothing is planned on that
        assert segment.calls == []
        # demand 300 rising 120/s against 320 pages: 100 short; merging the pairs frees 40 more, all there is
        segment.records = records(60)
        await leader.tick(1.0)
        segment.records = records(75)
        await leader.tick(1.5)
        assert segment.calls == [("drop", "b", "4:6"), ("drop", "c", "2:4"), ("drop", "d", "6:8"),
                                 ("drop", "a", "0:2")]
        assert leader.last_plan is not None and [g.members for g in leader.last_plan.groups] == [("a", "c", "b", "d")]
        assert leader.drops == 1

    asyncio.run(body())


def test_no_deeper_drop_is_planned_while_an_exchange_runs() -> None:
    async def body() -> None:
        segment = Segment([record(peer, 0, 8, kv=20) for peer in "abcd"])
        leader = segment.loop("a")
        await leader.tick(0.0)
        segment.records = [record(peer, 0, 8, kv=35) for peer in "abcd"]
        await leader.tick(0.5)
        assert segment.calls == [("drop", "b", "4:8"), ("drop", "a", "0:4")]  # the leader's own last
        segment.calls.clear()
        # a's victims move: their KV counts on both sides and a's dropped blocks still hold their parameters
        segment.records = [record(peer, 0, 8, kv=50, reshaping=peer == "a") for peer in "abcd"]
        await leader.tick(1.0)
        assert segment.calls == []
        segment.records = [record(peer, 0, 8, kv=60) for peer in "abcd"]  # the demand still rises once it ended
        await leader.tick(1.5)
        assert segment.calls == [("drop", "c", "0:4"), ("drop", "d", "4:8")]

    asyncio.run(body())


def test_a_session_that_every_member_refused_counts_once_in_the_segments_demand() -> None:
    async def body() -> None:
        # a client that found no room asked both servers: each counts its 30 pages in `kv_demand_pages`
        named = [refused_digests({"s1": 30, "s2": 10}), refused_digests({"s1": 30})]
        assert "s1" not in str(named)  # `info` names a digest, not the session's id
        twice = refused_twice(named)
        assert twice == 30
        # a session that a refused and b opened since waits no more: neither refusal counts
        assert refused_twice(named, opened_digests(["s1"])) == 60 and refused_twice(named, ["junk", 7]) == 30
        records = [record("a", 0, 8, kv=35, demand=40), record("b", 0, 8, kv=35, demand=30)]
        counted, deduplicated = Segment(list(records)), Segment(list(records))
        loops = [DropLoop("a", group=counted.group, drop=counted.drop, restore=counted.restore),
                 DropLoop("a", group=deduplicated.group, drop=deduplicated.drop, restore=deduplicated.restore,
                          extra_demand=lambda _: -twice)]
        for now in (0.0, 0.5):
            for loop in loops:
                await loop.tick(now)
        # 70 pages held and two sessions asking 40: 110 of the 120 KV pages, not 140
        assert [loop.to_wire()["demand_pages"] for loop in loops] == [140, 110]
        assert counted.calls and not deduplicated.calls

    asyncio.run(body())
