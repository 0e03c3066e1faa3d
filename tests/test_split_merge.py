"""A session's KV splits between two servers (a drop's exchange) and merges back (a restore), page for page, in
process: the source's `Migrations` talks to the destination's through a stand-in for the RPC stream that calls the
destination as its server's `import_*` handlers do. The live tests (`test_dropping.py`) run the same over hivemind."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from client.inference import RemoteInferenceSession, _Follow
from server import migration
from server.migration import Migrations, Part
from server.sessions import Session, SessionTable, StepResult
from swarm.errors import BlocksNotHosted, ChainChanged, Hop, InvalidTensor, SessionNotFound, SwarmError
from swarm.memory import KVOwner, PagePool
from swarm.model.paged_kv import PagedKV

KV_HEADS, HEAD_DIM, PAGE_BYTES = 2, 8, 1024  # 16 tokens a page in float32
TOKENS = 20


class Server:
    """One server's pool, sessions and migrations (blocks 0:4)."""

    def __init__(self, peer_id: str, pages: int = 64) -> None:
        self.pool = PagePool(pages * PAGE_BYTES, PAGE_BYTES)
        self.kv = PagedKV(self.pool.storage, PAGE_BYTES, kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=torch.float32)
        self.sessions = SessionTable(block_start=0, block_end=4, pool=self.pool,
                                     tokens_per_page=self.kv.tokens_per_page, max_length=64, headroom_tokens=0)
        self.migrations = Migrations(self.sessions, self.kv, torch.float32, hidden_size=16)
        self.migrations.peer_id = peer_id

    def session(self, session_id: str, start: int, end: int, seed: int) -> Session:
        """Opens a session with TOKENS tokens of random KV in each of its blocks."""
        session = self.sessions.open(session_id, start, end, batch=1, max_length=64, tokens=TOKENS, moved_in=True)
        generator = torch.Generator().manual_seed(seed)
        for block in range(start, end):
            keys, values = (torch.randn(TOKENS, KV_HEADS, HEAD_DIM, generator=generator) for _ in range(2))
            self.kv.write(session.page_tables[block][0], 0, keys, values)
        session.position = TOKENS
        return session

    def kv_of(self, session: Session, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.kv.read(session.page_tables[block][0], 0, session.position)
        return keys.clone(), values.clone()


class Stream:
    """Stands for the RPC stream from `source` to `destination`: each call does what the destination server's
    handler of that method does."""

    def __init__(self, source: Server, destination: Server) -> None:
        self.source, self.destination = source.migrations.peer_id, destination
        self.peer_id = destination.migrations.peer_id

    async def call(self, method: str, payload: dict[str, Any], timeout: float) -> dict[str, Any]:
        migrations, session_id = self.destination.migrations, payload["session_id"]
        if method == "import_open":
            migrations.open_import(self.source, session_id, *payload["blocks"], batch=payload["batch"],
                                   max_length=payload["max_length"], position=payload["position"],
                                   client=payload["client"], merge=payload.get("merge", False))
        elif method == "import_kv":
            for piece in payload["pieces"]:
                migrations.write_kv(self.source, session_id, piece["block"], piece["row"], piece["start"],
                                    piece["keys"], piece["values"])
        elif method == "import_commit":
            migrations.commit(self.source, session_id, payload["position"], payload.get("last_step_id"),
                              payload.get("last_output"))
        elif method == "import_abort":
            migrations.abort(self.source, session_id)
        return {}


def run(scenario: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(scenario())  # sessions create asyncio futures


def test_a_split_moves_the_dropped_blocks_kv_and_the_old_chain_learns_the_new_hops() -> None:
    async def scenario() -> None:
        a, b = Server("A"), Server("B")
        session = a.session("s", 0, 4, seed=1)
        before = {block: a.kv_of(session, block) for block in range(4)}
        hops = [Hop("A", 0, 2, "s"), Hop("B", 2, 4, "s")]
        await a.migrations.send(session, Stream(a, b), [], timeout_s=5.0, part=Part(2, 4, hops))  # type: ignore[arg-type]

        assert (session.start, session.end, session.position) == (0, 2, TOKENS)
        assert a.pool.pages_of(KVOwner("s", 2)) == () and a.pool.pages_of(KVOwner("s", 3)) == ()
        moved = b.sessions.get("s")
        assert (moved.start, moved.end, moved.position) == (2, 4, TOKENS)
        for block in (2, 3):
            assert all(torch.equal(x, y) for x, y in zip(b.kv_of(moved, block), before[block], strict=True))
        for block in (0, 1):
            assert all(torch.equal(x, y) for x, y in zip(a.kv_of(session, block), before[block], strict=True))
        with pytest.raises(ChainChanged) as changed:
            a.migrations.check_step("s", (0, 4))  # a step that still expects the whole session here
        assert (changed.value.hops, changed.value.position) == (hops, TOKENS)
        round_trip = SwarmError.from_wire(changed.value.to_wire())
        assert isinstance(round_trip, ChainChanged) and round_trip.hops == hops
        a.migrations.check_step("s", (0, 2))  # the new chain's step runs
        for server in (a, b):
            server.pool.check_invariants()

    run(scenario)


def test_a_merge_takes_a_buddys_part_back_into_the_session_and_frees_it_there() -> None:
    async def scenario() -> None:
        a, b = Server("A"), Server("B")
        head = a.session("s", 0, 2, seed=2)
        tail = b.session("t", 2, 4, seed=3)
        tail_kv = {block: b.kv_of(tail, block) for block in (2, 3)}
        merged = [Hop("A", 0, 4, "s")]
        await b.migrations.send(tail, Stream(b, a), [], timeout_s=5.0,  # type: ignore[arg-type]
                                part=Part(2, 4, merged, into="s", position=TOKENS))

        assert (head.start, head.end, head.position) == (0, 4, TOKENS)
        for block in (2, 3):
            assert all(torch.equal(x, y) for x, y in zip(a.kv_of(head, block), tail_kv[block], strict=True))
        assert b.pool.stats().pages_kv == 0
        with pytest.raises(ChainChanged) as changed:
            b.migrations.check_step("t", (2, 4))
        assert changed.value.hops == merged
        with pytest.raises(ChainChanged):
            a.migrations.check_step("s", (0, 2))  # the head's old expectation
        a.migrations.check_step("s", (0, 4))
        for server in (a, b):
            server.pool.check_invariants()

    run(scenario)


def test_a_merge_after_a_pushed_step_ran_through_both_parts_answers_that_step_again_with_the_tails_output() -> None:
    """The restore's merge can come between a pushed step and its client's requests for the outputs: both parts ran
    it. The merged session answers the step's id with the tail's output (the output of its last block now); a merge
    at a step only the head ran keeps no output, so a repeated step id finds nothing to answer with."""
    async def scenario() -> None:
        a, b = Server("A"), Server("B")
        head, tail = a.session("s", 0, 2, seed=8), b.session("t", 2, 4, seed=9)
        head_output, tail_output = torch.full((1, 1, 16), 1.0), torch.full((1, 1, 16), 2.0)
        head.last_step_id, head.last_result = "19", StepResult(head_output, 0.0, 0)
        tail.last_step_id, tail.last_result = "19", StepResult(tail_output, 0.0, 0)
        await b.migrations.send(tail, Stream(b, a), [], timeout_s=5.0,  # type: ignore[arg-type]
                                part=Part(2, 4, [Hop("A", 0, 4, "s")], into="s", position=TOKENS))
        assert (head.start, head.end, head.last_step_id) == (0, 4, "19")
        assert head.last_result is not None and torch.equal(head.last_result.output, tail_output)

        c, d = Server("C"), Server("D")
        head, tail = c.session("s", 0, 2, seed=8), d.session("t", 2, 4, seed=9)
        head.last_step_id, head.last_result = "19", StepResult(head_output, 0.0, 0)
        tail.last_step_id, tail.last_result = "18", StepResult(tail_output, 0.0, 0)
        await d.migrations.send(tail, Stream(d, c), [], timeout_s=5.0,  # type: ignore[arg-type]
                                part=Part(2, 4, [Hop("C", 0, 4, "s")], into="s", position=TOKENS))
        assert (head.start, head.end, head.last_step_id, head.last_result) == (0, 4, None, None)

    run(scenario)


def test_merges_that_cannot_hold_leave_both_sessions_as_they_were(monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario() -> None:
        a, b = Server("A"), Server("B")
        head = a.session("s", 0, 2, seed=4)
        free = a.pool.pages_free
        with pytest.raises(InvalidTensor):  # not next to the session
            a.migrations.open_import("B", "s", 3, 4, batch=1, max_length=64, position=TOKENS, client="", merge=True)
        with pytest.raises(SessionNotFound):  # at another position
            a.migrations.open_import("B", "s", 2, 4, batch=1, max_length=64, position=TOKENS - 1, client="",
                                     merge=True)
        assert a.pool.pages_free == free

        a.migrations.open_import("B", "s", 2, 4, batch=1, max_length=64, position=TOKENS, client="", merge=True)
        with pytest.raises(SessionNotFound):  # only the server that opened the merge writes into it
            a.migrations.write_kv("C", "s", 2, 0, 0, None, None)
        a.migrations.abort("B", "s")
        assert (head.start, head.end, a.pool.pages_free) == (0, 2, free)

        tail = b.session("t", 2, 4, seed=5)
        monkeypatch.setattr(migration, "STEP_WAIT_S", 0.2)
        with pytest.raises(SessionNotFound):  # the tail never reaches the position the head is at
            await b.migrations.send(tail, Stream(b, a), [], timeout_s=5.0,  # type: ignore[arg-type]
                                    part=Part(2, 4, [Hop("A", 0, 4, "s")], into="s", position=TOKENS + 1))
        assert (tail.start, tail.end) == (2, 4) and b.sessions.is_open(tail)
        assert (head.start, head.end, a.pool.pages_free) == (0, 2, free)
        for server in (a, b):
            server.pool.check_invariants()

    run(scenario)


def test_a_merge_into_blocks_the_server_dropped_meanwhile_is_refused_and_leaves_both_sessions_as_they_were() -> None:
    """A restore's merge runs while the restored server drops those blocks again (a burst): its commit finds them
    no longer hosted, the pages it took return, the head keeps its blocks and the tail stays whole on the buddy
    (a step over blocks the server unloaded would fail there)."""

    class DropsDuringCopy(Stream):
        async def call(self, method: str, payload: dict[str, Any], timeout: float) -> dict[str, Any]:
            if method == "import_commit":
                self.destination.sessions.set_range(0, 2)  # the drop: blocks 2:4 are gone from A
            return await super().call(method, payload, timeout)

    async def scenario() -> None:
        a, b = Server("A"), Server("B")
        head = a.session("s", 0, 2, seed=6)
        tail = b.session("t", 2, 4, seed=7)
        free, tail_kv = a.pool.pages_free, {block: b.kv_of(tail, block) for block in (2, 3)}
        with pytest.raises(BlocksNotHosted):
            await b.migrations.send(tail, DropsDuringCopy(b, a), [], timeout_s=5.0,  # type: ignore[arg-type]
                                    part=Part(2, 4, [Hop("A", 0, 4, "s")], into="s", position=TOKENS))
        assert (head.start, head.end, head.merging, a.pool.pages_free) == (0, 2, None, free)
        assert (tail.start, tail.end) == (2, 4) and b.sessions.is_open(tail)
        for block in (2, 3):
            assert all(torch.equal(x, y) for x, y in zip(b.kv_of(tail, block), tail_kv[block], strict=True))
        with pytest.raises(BlocksNotHosted):  # and a merge into blocks it does not host is refused at once
            a.migrations.open_import("B", "s", 2, 4, batch=1, max_length=64, position=TOKENS, client="", merge=True)
        assert a.pool.pages_free == free
        for server in (a, b):
            server.pool.check_invariants()

    run(scenario)


def _client(*spans: tuple[str, int, int, int]) -> SimpleNamespace:
    """A client's chain: (server, start, end, position) per span, each with one saved input."""
    client = SimpleNamespace(spans=[
        SimpleNamespace(span=SimpleNamespace(peer_id=peer, start=start, end=end), position=position, history=[None])
        for peer, start, end, position in spans
    ])
    client._lined_up = lambda *args: RemoteInferenceSession._lined_up(client, *args)
    return client


def test_the_client_follows_the_hops_over_its_own_span_when_the_servers_view_of_later_ones_is_old() -> None:
    """A server splits its part of a session after the next server had moved its part on: the hops it gives name the
    keeper twice (its new part, and the old next part the keeper once held). The client follows the hops over the
    span that answered, and the later span tells its own change when the step reaches it."""
    client = _client(("a", 0, 4, 9), ("c", 4, 8, 9))
    follow = RemoteInferenceSession._hops_to_follow
    stale = [Hop("a", 0, 2, "s"), Hop("b", 2, 4, "s"), Hop("b", 4, 8, "s2")]  # b moved 4:8 on to c meanwhile
    assert follow(client, 0, stale, 9) == _Follow([Hop("a", 0, 2, "s"), Hop("b", 2, 4, "s")], 0, 0, 9)
    fresh = [Hop("a", 0, 2, "s"), Hop("b", 2, 4, "s"), Hop("c", 4, 8, "s3")]
    assert follow(client, 0, fresh, 9) == _Follow(fresh, 0, 1, 9)  # a chain that lines up is followed whole
    assert follow(client, 0, [Hop("a", 0, 2, "s"), Hop("b", 3, 4, "s")], 9) is None  # a gap: replay
    assert follow(client, 0, stale, 8) is None  # another position: replay
    assert follow(client, 0, stale, 10) is None


def test_the_client_follows_a_merge_that_ran_the_step_in_flight_and_sends_that_step_again() -> None:
    """A restore's merge took a pushed step's parts together after each ran it: the merged part is one step ahead of
    the client's spans that have not answered yet. The client follows it at their position and sends the step again
    from the merged part's first span (the merged part answers the step's id again); any other lead, or a step of
    another length, is a replay."""
    client = _client(("a", 0, 2, 10), ("b", 2, 4, 9), ("c", 4, 8, 9))  # a answered step 9, b did not
    follow = RemoteInferenceSession._hops_to_follow
    into_b = [Hop("b", 2, 8, "s")]  # b took c's part after both ran step 9
    assert follow(client, 1, into_b, 10, 1) == _Follow(into_b, 1, 2, 9)
    assert follow(client, 1, into_b, 9, 1) == _Follow(into_b, 1, 2, 9)  # the merge came before the step: as before
    assert follow(client, 1, into_b, 10) is None
    assert follow(client, 1, into_b, 11, 1) is None
    into_a = [Hop("a", 0, 8, "s")]  # a took b's and c's parts after all ran step 9: it is sent again from a
    assert follow(client, 1, into_a, 10, 1) == _Follow(into_a, 0, 2, 9)
    assert follow(client, 1, into_a, 9, 1) is None  # a ran the step, so a merge through a at 9 lost it: replay
    later = _client(("a", 0, 2, 10), ("b", 2, 4, 10), ("c", 4, 8, 9))  # a and b answered step 9, c did not
    assert follow(later, 2, into_a, 10, 1) == _Follow(into_a, 0, 2, 9)
    later.spans[0].history = []  # no input saved for a's step: nothing to send it again with
    assert follow(later, 2, into_a, 10, 1) is None
