"""KunServe's live exchange between two servers' cores in one process: the lender dropped blocks 4:8 and lends their
KV; the keeper computes those blocks with its weights and has the lender attend until each block's KV has followed.
Requests travel as real frames (msgpack, size-checked) to the other side's handlers; no network."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import server.remote_attention as remote_attention
from server.migration import Migrations
from server.remote_attention import RemoteAttention
from server.scheduler import StepScheduler
from server.sessions import Session, SessionTable, Step, StepResult
from swarm.errors import ChainChanged, Hop, MigrationRefused, PeerUnreachable, SessionNotFound, SwarmError
from swarm.memory import PagePool
from swarm.model import BlockRange, resolve_model
from swarm.rpc import CallContext
from swarm.wire import pack_frame, unpack_body
from tests.reference import ReferenceBlocks

HIDDEN = 64
PAGE_TOKENS = 16
PAGES = 160


class Core:
    """One server's hosting core without the network: blocks 0:8 of the tiny Llama, its pool, sessions, scheduler
    and both ends of remote attention."""

    def __init__(self, model: Path, peer_id: str, *, chunk_bytes: int) -> None:
        self.peer_id = peer_id
        self.source = resolve_model(str(model))
        self.blocks = BlockRange(self.source, 0, 8)
        page_bytes = PAGE_TOKENS * self.blocks.kv_bytes_per_token()
        self.pool = PagePool(PAGES * page_bytes, page_bytes)
        self.kv = self.blocks.paged_kv(self.pool.storage, page_bytes)
        self.dtype = torch.float32
        self.sessions = SessionTable(block_start=0, block_end=8, pool=self.pool, tokens_per_page=PAGE_TOKENS,
                                     max_length=256, headroom_tokens=0)
        self.migrations = Migrations(self.sessions, self.kv, self.dtype, HIDDEN, chunk_bytes=chunk_bytes)
        self.config = SimpleNamespace(push_timeout_s=10.0, max_frame_bytes=1 << 20, max_length=256)
        self.p2p = object()
        self.remote = RemoteAttention(self)  # type: ignore[arg-type]
        self.scheduler = StepScheduler(self.blocks, self.kv, self.sessions, max_batch_tokens=64, inline_step_ms=0,
                                       block_compute_ms=1.0, on_steps_done=lambda steps: None,
                                       remote_forward=self.remote.forward)
        self.handlers: dict[str, Callable[[dict[str, Any], CallContext], Awaitable[dict[str, Any]]]] = {
            "attend_open": self.remote.open, "attend": self.remote.attend, "attend_read": self.remote.read,
            "attend_release": self.remote.release, "close": self.close}

    async def close(self, payload: dict[str, Any], ctx: CallContext) -> dict[str, Any]:
        """The server's `close` RPC: closes a session by its id (SessionNotFound if it is not open)."""
        self.sessions.get(payload["session_id"])
        self.sessions.close(payload["session_id"])
        return {}

    def record(self) -> Any:
        return SimpleNamespace(addrs=[])

    async def step(self, session: Session, hidden: torch.Tensor) -> torch.Tensor:
        """Runs one step of `session` as the server admits it (pages first) and gives its output rows."""
        self.sessions.grow(session, session.position + hidden.shape[1])
        result: asyncio.Future[StepResult] = asyncio.get_running_loop().create_future()
        step = Step(session, f"{session.position}", hidden, result)
        session.running = step
        self.scheduler.submit(step)
        return (await result).output


class Stream:
    """A stream from one core to another: each call is packed into a frame and unpacked on the other side, as on
    the wire; `delay_s` holds each reply (a slow link)."""

    def __init__(self, caller: Core, callee: Core, delay_s: float) -> None:
        self.caller, self.callee, self.delay_s = caller, callee, delay_s
        self.is_closed = False
        self.calls: list[str] = []

    async def call(self, method: str, payload: dict[str, Any], *, timeout: float) -> dict[str, Any]:
        if self.is_closed:
            raise SessionNotFound("stream closed")
        request = unpack_body(pack_frame(payload)[4:])
        self.calls.append(method)
        reply = await self.callee.handlers[method](request, CallContext(self.caller.peer_id, 0))
        await asyncio.sleep(self.delay_s)
        return unpack_body(pack_frame(reply)[4:])

    async def close(self) -> None:
        self.is_closed = True


def connect(cores: dict[str, Core], monkeypatch: pytest.MonkeyPatch, *, delay_s: float) -> list[Stream]:
    """Makes `dial` from any core reach the core of the peer id dialled; gives the streams opened."""
    streams: list[Stream] = []

    async def dial(p2p: object, peer_id: str, addrs: list[str], **_: object) -> Stream:
        caller = next(core for core in cores.values() if core.p2p is p2p)
        streams.append(Stream(caller, cores[peer_id], delay_s))
        return streams[-1]

    monkeypatch.setattr(remote_attention, "dial", dial)
    return streams


def started_pair(model: Path, monkeypatch: pytest.MonkeyPatch, *, chunk_bytes: int,
                 delay_s: float) -> tuple[Core, Core, dict[str, Core], list[Stream]]:
    """Gives a running lender and keeper, connected by streams whose replies wait `delay_s`."""
    lender, keeper = (Core(model, name, chunk_bytes=chunk_bytes) for name in ("lender", "keeper"))
    cores = {"lender": lender, "keeper": keeper}
    streams = connect(cores, monkeypatch, delay_s=delay_s)
    for core in cores.values():
        core.scheduler.start()
    return lender, keeper, cores, streams


def opened(core: Core, session_id: str) -> Session | None:
    """Gives the open session `session_id` of `core`, or None."""
    return next((session for session in core.sessions if session.session_id == session_id), None)


async def close_all(cores: dict[str, Core], baseline: dict[str, int]) -> None:
    """Closes every session, stops both ends of every core, and checks each pool is back at its baseline."""
    for core in cores.values():
        for session in list(core.sessions):
            core.sessions.close(session.session_id)
        await core.scheduler.stop()
        await core.remote.stop()
    for name, core in cores.items():
        core.pool.check_invariants()
        assert core.pool.pages_free == baseline[name]


def test_the_keeper_attends_on_the_lender_until_the_kv_followed_and_every_output_equals_the_local_blocks(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(remote_attention, "TAIL_TOKENS", 0)  # a block switches only once its copy is complete

    async def body() -> None:
        # chunks of 4 tokens of one block, each reply held 10 ms: the copy of 4 x 40 tokens takes ~0.4 s, over
        # which the session's steps attend on the lender
        lender, keeper, cores, streams = started_pair(tiny_llama, monkeypatch, chunk_bytes=4 * 256, delay_s=0.01)
        reference = ReferenceBlocks(lender.source, 0, 8)
        generator = torch.Generator().manual_seed(0)
        baseline = {name: core.pool.pages_free for name, core in cores.items()}

        session = lender.sessions.open("s", 0, 8, batch=1, max_length=256)
        prompt = torch.randn(1, 40, HIDDEN, generator=generator)
        torch.testing.assert_close(await lender.step(session, prompt), reference(prompt), rtol=1e-5, atol=1e-5)

        hops = [Hop("lender", 0, 4, "s"), Hop("keeper", 4, 8, "s")]
        await lender.remote.lend(session, "keeper", [], 4, 8, hops)
        for index in range(4, 8):  # the lender drops the blocks' weights: attention needs none
            lender.blocks.unload_block(index)
        assert (session.start, session.end, session.hops) == (0, 4, hops)
        kept = keeper.sessions.get("s")
        assert (kept.start, kept.end, kept.position) == (4, 8, 40)
        assert lender.remote.stats.lent_blocks_open == 4

        remote_steps = 0
        for _ in range(24):
            hidden = torch.randn(1, 1, HIDDEN, generator=generator)
            remote_steps += kept.remote is not None
            output = await keeper.step(kept, await lender.step(session, hidden))
            torch.testing.assert_close(output, reference(hidden), rtol=1e-5, atol=1e-5)
            if kept.remote is None and remote_steps >= 2:
                break
            await asyncio.sleep(0.03)
        assert kept.remote is None, "the copy did not end"
        assert remote_steps >= 2  # steps went on while the KV was still lent
        stats = keeper.remote.stats
        assert stats.switched_blocks == 4 and stats.attends_sent == lender.remote.stats.attends_served >= 8
        assert stats.copied_bytes >= 4 * 40 * 256  # every block's prompt, 256 bytes a token
        assert lender.remote.stats.lent_blocks_open == 0
        assert {"attend", "attend_read"} <= {call for stream in streams for call in stream.calls}
        assert keeper.scheduler.stats.steps_by_place["remote"] == remote_steps

        hidden = torch.randn(1, 1, HIDDEN, generator=generator)  # all here: a batched step again
        output = await keeper.step(kept, await lender.step(session, hidden))
        torch.testing.assert_close(output, reference(hidden), rtol=1e-5, atol=1e-5)
        assert keeper.scheduler.stats.steps_by_place["remote"] == remote_steps

        lender.sessions.close("s")
        keeper.sessions.close("s")
        for name, core in cores.items():
            core.pool.check_invariants()
            assert core.pool.pages_free == baseline[name]
        for core in cores.values():
            await core.scheduler.stop()
            await core.remote.stop()

    asyncio.run(body())


def test_a_session_that_closes_on_the_keeper_gives_the_lent_kv_back_and_a_lost_lender_fails_the_step_alone(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def body() -> None:
        # slow: the copy of 30 tokens a token a call takes 1.5 s a block
        lender, keeper, cores, _ = started_pair(tiny_llama, monkeypatch, chunk_bytes=256, delay_s=0.05)
        generator = torch.Generator().manual_seed(1)
        baseline = {name: core.pool.pages_free for name, core in cores.items()}
        hops = [Hop("lender", 0, 4, "a"), Hop("keeper", 4, 8, "a")]
        sessions = {}
        for name in ("a", "b"):
            sessions[name] = lender.sessions.open(name, 0, 8, batch=1, max_length=256)
            await lender.step(sessions[name], torch.randn(1, 100, HIDDEN, generator=generator))
            await lender.remote.lend(sessions[name], "keeper", [], 4, 8, hops)
        assert lender.remote.stats.lent_blocks_open == 8

        keeper.sessions.close("a")  # its client went away: the copier gives the lent KV back
        for _ in range(100):
            if lender.remote.stats.lent_blocks_open == 4:
                break
            await asyncio.sleep(0.05)
        assert lender.remote.stats.lent_blocks_open == 4

        async def unreachable(*_: object, **__: object) -> Stream:
            raise PeerUnreachable("the lender is gone")

        monkeypatch.setattr(remote_attention, "dial", unreachable)  # the lender died before b's next step
        kept = keeper.sessions.get("b")
        with pytest.raises(SwarmError) as failed:
            await keeper.step(kept, torch.randn(1, 1, HIDDEN, generator=generator))
        assert isinstance(failed.value, SessionNotFound) and "did not attend" in failed.value.message
        assert keeper.remote.stats.lost == 1
        assert keeper.sessions.is_open(kept) and kept.running is None  # the client replays it elsewhere

        await close_all(cores, baseline)

    asyncio.run(body())


def test_a_keeper_whose_pool_is_full_takes_the_victim_at_once_and_its_kv_follows_once_pages_free(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def body() -> None:
        lender, keeper, cores, _ = started_pair(tiny_llama, monkeypatch, chunk_bytes=8 * 256, delay_s=0.005)
        reference = ReferenceBlocks(lender.source, 0, 8)
        generator = torch.Generator().manual_seed(2)
        baseline = {name: core.pool.pages_free for name, core in cores.items()}

        session = lender.sessions.open("s", 0, 8, batch=1, max_length=256)
        prompt = torch.randn(1, 40, HIDDEN, generator=generator)
        torch.testing.assert_close(await lender.step(session, prompt), reference(prompt), rtol=1e-5, atol=1e-5)
        # the keeper's pool is full but for 2 pages (its own sessions), where the victim's 4 blocks need 12
        keeper.sessions.open("full", 0, 8, batch=1, max_length=256, tokens=256)
        keeper.sessions.open("fuller", 0, 6, batch=1, max_length=256, tokens=80)
        assert keeper.pool.pages_free == 2

        hops = [Hop("lender", 0, 4, "s"), Hop("keeper", 4, 8, "s")]
        await lender.remote.lend(session, "keeper", [], 4, 8, hops)  # before stop 45: ServerBusy, no room
        kept = keeper.sessions.get("s")
        assert kept.pages_held == 0 and kept.remote is not None and (kept.start, kept.end) == (4, 8)
        for _ in range(5):  # its steps attend on the lender; the copy waits for room
            hidden = torch.randn(1, 1, HIDDEN, generator=generator)
            output = await keeper.step(kept, await lender.step(session, hidden))
            torch.testing.assert_close(output, reference(hidden), rtol=1e-5, atol=1e-5)
            await asyncio.sleep(0.02)
        assert kept.remote is not None and kept.pages_held == 0 and keeper.pool.pages_free == 2
        assert lender.remote.stats.lent_blocks_open == 4

        keeper.sessions.close("full")  # room: the copy takes the blocks' pages and their KV follows
        for _ in range(40):
            hidden = torch.randn(1, 1, HIDDEN, generator=generator)
            output = await keeper.step(kept, await lender.step(session, hidden))
            torch.testing.assert_close(output, reference(hidden), rtol=1e-5, atol=1e-5)
            if kept.remote is None:
                break
            await asyncio.sleep(0.02)
        assert kept.remote is None, "the KV did not follow"
        assert lender.remote.stats.lent_blocks_open == 0 and keeper.remote.stats.switched_blocks == 4
        hidden = torch.randn(1, 1, HIDDEN, generator=generator)  # all here: a batched step again
        output = await keeper.step(kept, await lender.step(session, hidden))
        torch.testing.assert_close(output, reference(hidden), rtol=1e-5, atol=1e-5)

        await close_all(cores, baseline)

    asyncio.run(body())


def test_a_victim_its_client_closes_while_it_is_being_lent_leaves_no_part_or_page_behind_and_a_refused_one_goes_on(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def body() -> None:
        # each reply held 50 ms: the keeper has opened its part before the lender hears so
        lender, keeper, cores, streams = started_pair(tiny_llama, monkeypatch, chunk_bytes=256, delay_s=0.05)
        reference = ReferenceBlocks(lender.source, 0, 8)
        generator = torch.Generator().manual_seed(3)
        baseline = {name: core.pool.pages_free for name, core in cores.items()}
        hops = [Hop("lender", 0, 4, "s"), Hop("keeper", 4, 8, "s")]

        session = lender.sessions.open("s", 0, 8, batch=1, max_length=256)
        await lender.step(session, torch.randn(1, 40, HIDDEN, generator=generator))
        lending = asyncio.create_task(lender.remote.lend(session, "keeper", [], 4, 8, hops))
        for _ in range(100):
            if opened(keeper, "s") is not None:
                break
            await asyncio.sleep(0.005)
        assert getattr(opened(keeper, "s"), "remote", None) is not None  # open there, its KV lent
        lender.sessions.close("s")  # its client had its last token: the close comes while the keeper answers
        with pytest.raises(SessionNotFound, match="closed while it was being lent"):
            await lending
        # before r72: the keeper's part stayed open (its copy holding pages) until the session timeout, and the
        # lender's lent blocks pointed at pages the close had freed
        assert opened(keeper, "s") is None and "close" in streams[0].calls
        assert lender.remote.stats.lent_blocks_open == 0
        for _ in range(100):  # the keeper's copier ends with its session
            if not keeper.remote._copiers:
                break
            await asyncio.sleep(0.01)
        for name, core in cores.items():
            core.pool.check_invariants()
            assert core.pool.pages_free == baseline[name], name

        async def refuse(payload: dict[str, Any], ctx: CallContext) -> dict[str, Any]:
            raise MigrationRefused("the keeper takes no victim now")

        keeper.handlers["attend_open"] = refuse
        session = lender.sessions.open("t", 0, 8, batch=1, max_length=256)
        prompt = torch.randn(1, 40, HIDDEN, generator=generator)
        torch.testing.assert_close(await lender.step(session, prompt), reference(prompt), rtol=1e-5, atol=1e-5)
        held = lender.pool.pages_free
        with pytest.raises(MigrationRefused):
            await lender.remote.lend(session, "keeper", [], 4, 8, [Hop("lender", 0, 4, "t"), Hop("keeper", 4, 8, "t")])
        assert (session.start, session.end) == (0, 8) and lender.pool.pages_free == held
        assert lender.pool.has_session("t") and lender.remote.stats.lent_blocks_open == 0
        hidden = torch.randn(1, 1, HIDDEN, generator=generator)  # its KV is its own again: it goes on here
        torch.testing.assert_close(await lender.step(session, hidden), reference(hidden), rtol=1e-5, atol=1e-5)

        await close_all(cores, baseline)

    asyncio.run(body())


def test_a_lent_victim_closed_before_its_client_learned_the_new_chain_names_its_keepers_part_to_close(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def body() -> None:
        lender, _, cores, _ = started_pair(tiny_llama, monkeypatch, chunk_bytes=8 * 256, delay_s=0.0)
        generator = torch.Generator().manual_seed(4)
        baseline = {name: core.pool.pages_free for name, core in cores.items()}
        for name in ("untold", "told"):
            session = lender.sessions.open(name, 0, 8, batch=1, max_length=256)
            await lender.step(session, torch.randn(1, 20, HIDDEN, generator=generator))
            await lender.remote.lend(session, "keeper", ["/ip4/127.0.0.1/tcp/1"], 4, 8,
                                     [Hop("lender", 0, 4, name), Hop("keeper", 4, 8, name)])
        with pytest.raises(ChainChanged):  # a step that expects it whole learns the chain: its client closes it all
            lender.migrations.check_step("told", (0, 8))
        lender.sessions.close("told")
        assert lender.sessions.take_untold_parts() == []
        lender.sessions.close("untold")  # closed with no step since the lending: its client knows no keeper
        assert lender.sessions.take_untold_parts() == [("untold", "keeper", ["/ip4/127.0.0.1/tcp/1"])]
        assert lender.sessions.take_untold_parts() == []
        await close_all(cores, baseline)

    asyncio.run(body())
