"""Min-latency routing over DHT records (pure): cheapest chain, penalties, bans, no route."""

from __future__ import annotations

import pytest

from client.routing import find_route, kv_fits, servers_of
from swarm.errors import NoRouteFound
from swarm.records import ServerRecord


def record(peer_id: str, start: int, end: int, *, compute_ms: float = 1.0, pages_free: int = 1000,
           state: str = "online", sessions_fit: int | None = None) -> ServerRecord:
    if sessions_fit is None:
        sessions_fit = pages_free // (end - start)
    return ServerRecord(
        peer_id=peer_id, model_id="m", block_start=start, block_end=end, state=state, pages_total=pages_free + 10,
        pages_params=10, pages_kv=0, pages_free=pages_free, sessions_fit=sessions_fit, page_bytes=1 << 20,
        kv_bytes_per_token=1024,
        block_compute_ms=compute_ms, network_mbps=None, session_count=0, max_length=2048, dtype="float32",
        quant="none", version="test", public_name=None, addrs=[],
    )


def servers(*records: ServerRecord) -> dict[str, ServerRecord]:
    return {r.peer_id: r for r in records}


def route_of(spans) -> list[tuple[str, int, int]]:  # type: ignore[no-untyped-def]
    return [(span.peer_id, span.start, span.end) for span in spans]


def test_fewer_hops_win_when_rtt_dominates() -> None:
    swarm = servers(record("a", 0, 4), record("b", 4, 8), record("c", 0, 8))
    rtt = {"a": 10.0, "b": 10.0, "c": 10.0}
    assert route_of(find_route(swarm, 0, 8, rtt_ms=rtt, max_length=64)) == [("c", 0, 8)]


def test_slow_compute_is_routed_around() -> None:
    swarm = servers(record("a", 0, 4), record("b", 4, 8), record("slow", 0, 8, compute_ms=50.0))
    rtt = {"a": 1.0, "b": 1.0, "slow": 1.0}
    assert route_of(find_route(swarm, 0, 8, rtt_ms=rtt, max_length=64)) == [("a", 0, 4), ("b", 4, 8)]


def test_overlapping_servers_can_be_entered_mid_range() -> None:
    swarm = servers(record("a", 0, 5), record("b", 3, 8))
    spans = find_route(swarm, 0, 8, rtt_ms={"a": 1.0, "b": 1.0}, max_length=64)
    assert [s.peer_id for s in spans] == ["a", "b"] and spans[0].end == spans[1].start
    assert route_of(find_route(swarm, 4, 8, rtt_ms={"a": 1.0, "b": 1.0}, max_length=64)) == [("b", 4, 8)]


def test_servers_without_free_pages_are_penalized_not_excluded() -> None:
    full = record("full", 0, 8, pages_free=0)
    assert route_of(find_route(servers(full), 0, 8, rtt_ms={}, max_length=64)) == [("full", 0, 8)]
    swarm = servers(full, record("a", 0, 8, compute_ms=20.0))
    assert route_of(find_route(swarm, 0, 8, rtt_ms={"full": 1.0, "a": 50.0}, max_length=64)) == [("a", 0, 8)]


def test_a_server_whose_headroom_rule_admits_no_session_counts_as_full() -> None:
    # Free pages that running sessions are expected to grow into do not make room for a new session.
    reserved = record("reserved", 0, 8, pages_free=16, sessions_fit=0)
    assert not kv_fits(reserved, 8)
    assert kv_fits(record("one", 0, 8, sessions_fit=1), 8)
    assert not kv_fits(record("one", 0, 8, sessions_fit=1), 8, batch=2)
    # A session on half the blocks takes half the room of one over all of them.
    assert kv_fits(record("one", 0, 8, sessions_fit=1), 4, batch=2)
    swarm = servers(reserved, record("a", 0, 8, compute_ms=20.0))
    rtt = {"reserved": 1.0, "a": 50.0}
    assert route_of(find_route(swarm, 0, 8, rtt_ms=rtt, max_length=2048)) == [("a", 0, 8)]


def test_banned_and_draining_servers_are_skipped_and_gaps_raise() -> None:
    swarm = servers(record("a", 0, 8), record("b", 0, 8))
    assert route_of(find_route(swarm, 0, 8, rtt_ms={}, max_length=64, banned={"a"})) == [("b", 0, 8)]
    online = servers_of([{"x": record("x", 0, 4, state="draining"), "y": record("y", 0, 4)}])
    assert list(online) == ["y"]
    with pytest.raises(NoRouteFound):
        find_route(servers(record("a", 0, 4), record("b", 5, 8)), 0, 8, rtt_ms={}, max_length=64)


def test_a_spot_check_covers_a_span_with_the_fewest_other_servers_or_reports_a_gap() -> None:
    from client.verification import cover

    assert route_of(cover([record("a", 0, 2), record("b", 0, 4), record("c", 2, 8)], 0, 4)) == [("b", 0, 4)]
    chain = cover([record("a", 0, 2), record("c", 1, 3), record("d", 2, 9)], 0, 6)
    assert route_of(chain) == [("a", 0, 2), ("d", 2, 6)]  # a 1:3 hop would need one more
    assert cover([record("a", 0, 2), record("d", 3, 9)], 0, 6) is None
    assert cover([], 0, 1) is None
