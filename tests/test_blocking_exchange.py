"""KunServe's blocking exchange on one server (`server.exchange.BlockExchange`, spec 3.5 and 5.2): from the drop on,
the victims' steps wait until their KV has moved, so nothing computes over the dropped blocks any more and their
parameter pages are free at once, for new sessions and for the KV the group-mates' victims bring. Before, the victims
decoded on until their own turn, and the pages came free only once the last victim had moved: in the 20-ms run r10
the arrivals of the burst's first seconds were refused with "0 are free" for 4 s after the drop."""

from __future__ import annotations

from pathlib import Path

import pytest

from server.exchange import BlockExchange
from swarm.errors import BlocksDropped
from tests.test_hosting import Core, run, until


class LoneHost:
    """A server's exchange host without a network: no DHT, so no victim finds a keeper."""

    def __init__(self, core: Core) -> None:
        self.hosting, self.sessions, self.scheduler, self.dht, self.p2p = (core.hosting, core.sessions,
                                                                           core.scheduler, None, None)

    @property
    def peer_id(self) -> str:
        return "me"

    def announce_soon(self) -> None:
        """Nothing to announce to."""


@pytest.mark.parametrize("setting", ["blocking", "auto"])
def test_blocking_victims_wait_from_the_drop_and_the_dropped_blocks_pages_are_free_at_once(
    tiny_llama: Path, setting: str
) -> None:
    async def body() -> None:
        core = Core(tiny_llama, 0, 8, pool_blocks=8, kv_pages=64)
        core.scheduler.start()
        kept, victim = core.open("kept", 0, 4), core.open("victim", 0, 8)
        for session in (kept, victim):
            await core.step_exactly(session, 5)
        block_pages = core.params_pages()[4]
        free_before = core.pool.stats().pages_free

        victims = await core.hosting.drop(0, 4, evict=False)  # the exchange's drop: victims stay for their KV
        assert victims == ["victim"]
        assert sorted(core.params_pages()) == list(range(8))  # the victim may still compute over 4:8

        exchange = BlockExchange(LoneHost(core), setting)  # type: ignore[arg-type]
        exchange.after_drop(victims)
        assert victim.awaiting_exchange is not None  # its steps wait from now on
        assert sorted(core.params_pages()) == [0, 1, 2, 3]  # so blocks 4:8 go at once
        assert core.pool.stats().pages_free == free_before + 4 * block_pages
        assert core.sessions.is_open(victim) and victim.pages_held > 0  # its KV waits for a keeper
        waiting = victim.awaiting_exchange
        await core.step_exactly(kept, 1)  # the kept blocks compute on

        # no keeper takes it (no DHT here): after EXCHANGE_STUCK_S it is evicted for its client's replay, and its
        # waiting steps go on to learn that
        await until(lambda: waiting.done(), timeout_s=10)
        assert victim.awaiting_exchange is None and exchange.stats.replayed == 1
        with pytest.raises(BlocksDropped, match="keeps 0:4"):
            core.sessions.get("victim")
        await until(lambda: not exchange.reshaping, timeout_s=5)
        core.pool.check_invariants()

    run(body)


def test_a_victim_computing_at_the_drop_keeps_the_blocks_until_its_batch_ends_then_waits(tiny_llama: Path) -> None:
    async def body() -> None:
        core = Core(tiny_llama, 0, 8, pool_blocks=8, kv_pages=64)
        core.scheduler.start()
        victim = core.open("victim", 0, 8)
        await core.step_exactly(victim, 3)
        result = await core.computing(victim, 30)

        exchange = BlockExchange(LoneHost(core), "blocking")  # type: ignore[arg-type]
        exchange.after_drop(await core.hosting.drop(4, 8, evict=False))
        assert sorted(core.params_pages()) == list(range(8))  # its batch still computes with blocks 0:4
        await result  # the step that began before the drop ends
        await until(lambda: sorted(core.params_pages()) == [4, 5, 6, 7], timeout_s=5)
        assert victim.awaiting_exchange is not None  # and nothing of it computes here again until its KV moved
        await exchange.stop()
        assert victim.awaiting_exchange is None
        core.pool.check_invariants()

    run(body)
