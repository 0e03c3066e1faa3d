"""A restore's merge rounds (`server.exchange.BlockExchange._merge_all`) on a fake server: a part that refused
because it grew is asked for again once a step names its new end, and the rounds end once no merge came for
`MERGE_IDLE_S`, or at once when the server drops blocks again. [The live race, on a loaded machine: the first
server asked for its mate's part 2:4 just as that part took 4:8 back; the export refused the stale range, and the
step naming 2:8 came rounds later.]"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from server import exchange as exchange_module
from server.exchange import BlockExchange
from swarm.errors import MigrationRefused


def fake_server(session: SimpleNamespace) -> SimpleNamespace:
    async def announce_now() -> None:
        return None

    return SimpleNamespace(peer_id="me", hosting=SimpleNamespace(serving=(0, 8), drops=1), sessions=[session],
                           announce_now=announce_now)


def session_through(hop_end: int) -> SimpleNamespace:
    """A session that runs 0:2 here and its next part, 2:`hop_end`, on the buddy."""
    return SimpleNamespace(session_id="s", start=0, end=2, merging=None, importing_from=None, closed=False,
                           later_hops=1, next_hop=SimpleNamespace(peer_id="buddy", session_id="part", start=2,
                                                                  end=hop_end))


def exchange_pulling(session: SimpleNamespace, refuse_end: int | None) -> tuple[BlockExchange, list[int]]:
    """An exchange whose pulls are recorded; the buddy refuses the part that ends at `refuse_end`."""
    exchange = BlockExchange(fake_server(session), "blocking")  # type: ignore[arg-type]
    pulled: list[int] = []

    async def pull(pulling: SimpleNamespace, peer_id: str, remote_id: str, remote_end: int) -> None:
        assert (pulling, peer_id, remote_id) == (session, "buddy", "part")
        pulled.append(remote_end)
        if remote_end == refuse_end:
            raise MigrationRefused(f"blocks 2:{remote_end} are not the part's range any more")
        session.end, session.next_hop, session.later_hops = remote_end, None, 0

    exchange._pull = pull  # type: ignore[method-assign,assignment]
    return exchange, pulled


def test_a_part_that_refused_as_it_grew_is_taken_back_once_a_step_names_its_new_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(exchange_module, "MERGE_ROUND_S", 0.01)
    monkeypatch.setattr(exchange_module, "MERGE_IDLE_S", 5.0)
    session = session_through(4)
    exchange, pulled = exchange_pulling(session, refuse_end=4)

    async def body() -> None:
        rounds = asyncio.create_task(exchange._merge_all(1))
        await asyncio.sleep(0.2)  # rounds later, the client's next step names the grown part
        assert pulled == [4] and not rounds.done()
        session.next_hop = SimpleNamespace(peer_id="buddy", session_id="part", start=2, end=8)
        await asyncio.wait_for(rounds, timeout=4.0)  # ends as soon as no session here has a part to take back

    asyncio.run(body())
    assert pulled == [4, 8] and session.end == 8
    assert (exchange.stats.merged, exchange.stats.merge_failed) == (1, 1)


def test_a_part_that_refuses_for_good_is_asked_once_and_the_rounds_end_after_the_idle_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(exchange_module, "MERGE_ROUND_S", 0.01)
    monkeypatch.setattr(exchange_module, "MERGE_IDLE_S", 0.3)
    session = session_through(4)
    exchange, pulled = exchange_pulling(session, refuse_end=4)
    asyncio.run(asyncio.wait_for(exchange._merge_all(1), timeout=5.0))
    assert pulled == [4] and session.end == 2  # the session stays on its chain through the buddy
    assert (exchange.stats.merged, exchange.stats.merge_failed) == (0, 1)


def test_a_drop_during_the_rounds_ends_them_at_once_so_that_its_exchange_need_not_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(exchange_module, "MERGE_ROUND_S", 0.01)
    monkeypatch.setattr(exchange_module, "MERGE_IDLE_S", 60.0)
    session = session_through(4)
    exchange, pulled = exchange_pulling(session, refuse_end=4)

    async def body() -> None:
        rounds = asyncio.create_task(exchange._merge_all(1))
        await asyncio.sleep(0.1)
        assert pulled == [4] and not rounds.done()  # the part refused: the rounds wait for a step naming its end
        exchange.server.hosting.drops = 2  # a burst: the server drops blocks again
        await asyncio.wait_for(rounds, timeout=2.0)  # not after the 60-s idle time

    asyncio.run(body())
    assert pulled == [4] and session.end == 2
