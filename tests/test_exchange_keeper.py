"""Where a victim's KV goes in a drop's exchange (`server.exchange._keeper`): to the host of its dropped blocks with the
most free pages in its record, even when that record shows too few. Buddies free pages for each other while they
exchange (each victim that leaves a member frees KV pages there), and records lag behind: the keeper's admission
answers whether the part fits (`ServerBusy`), so a stale record no longer evicts a victim that would fit."""

from __future__ import annotations

from server.exchange import _keeper
from swarm.records import ServerRecord
from tests.test_records import make_wire


def record(peer: str, start: int, end: int, free: int) -> ServerRecord:
    parsed = ServerRecord.from_wire(make_wire(peer_id=peer, block_start=start, block_end=end, pages_total=140,
                                              pages_params=40, pages_kv=100 - free, pages_free=free))
    assert parsed is not None
    return parsed


def test_the_host_with_the_most_free_pages_is_tried_even_when_its_record_shows_no_room() -> None:
    records = [record("me", 0, 15, 0), record("buddy", 15, 30, 0), record("third", 0, 30, 4), record("far", 0, 10, 90)]
    assert _keeper(records, 15, 30, "me") == records[2]  # of the hosts of 15:30, the most free pages
    assert _keeper(records[:2], 15, 30, "me") == records[1]  # the buddy's record shows 0 free: it is asked anyway
    assert _keeper(records[:2], 0, 15, "me") is None  # nobody else hosts 0:15
