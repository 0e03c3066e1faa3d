"""Announce and discover server records on a hivemind DHT: one expiring entry per hosted block, subkeyed by peer.

A server stores its `ServerRecord` under `block_key(model_id, i)` for every block i it hosts, and under
`servers_key(model_id)`, with `subkey = peer_id`, so one key lists every server of that block and one every server
of the model (the orchestrator reads that one, which also lists servers waiting for their first blocks). Entries
expire unless refreshed (`Announcer`), which is how a crashed server leaves the swarm. Anyone can write any key, so
`lookup` keeps only records that validate and that match the key and subkey they were found under. The swarm's
nodes refuse values that are not signed records of their subkey's peer, and bound what a flooded key costs
(`swarm.signing`, `swarm.dht_limits`).

The coroutines below run inside the DHT's own process (`DHT.run_coroutine` pickles them), so they
are module-level functions bound with `functools.partial`, never closures.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import TimeoutError as FutureTimeoutError
from functools import partial
from typing import Any, TypeVar

import hivemind
from hivemind.dht import DHTNode
from hivemind.utils import ValueWithExpiration, get_dht_time
from hivemind.utils.mpfuture import MPFuture

from swarm.dht_limits import LOOKUP_KEYS_PER_REQUEST, check_record_ttl
from swarm.errors import RpcTimeout
from swarm.records import OrchestratorRecord, ServerRecord, ServerState

logger = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_DHT_TIMEOUT_S = 30.0
# A replacement entry must expire strictly later than the one it replaces (hivemind keeps the later one).
_EXPIRATION_EPSILON_S = 1e-3


def block_key(model_id: str, block_index: int) -> str:
    """Gives the DHT key under which servers of one block announce themselves."""
    return f"{model_id}.{block_index}"


def servers_key(model_id: str) -> str:
    """Gives the DHT key under which every server of a model announces itself, hosting blocks or not yet."""
    return f"{model_id}.servers"


def record_keys(record: ServerRecord) -> list[str]:
    """Gives the DHT keys of every block the record's server hosts, and the model's key of all its servers."""
    blocks = [block_key(record.model_id, block_index) for block_index in record.block_range]
    return [*blocks, servers_key(record.model_id)]


async def _store_under_keys(
    _dht: hivemind.DHT, node: DHTNode, *, keys: list[str], subkey: str, value: dict, expiration_time: float
) -> bool:
    store_ok = await node.store_many(
        keys, [value] * len(keys), expiration_time=expiration_time, subkeys=[subkey] * len(keys)
    )
    return all(bool(stored) for stored in store_ok.values())


async def _get_latest_subkeys(_dht: hivemind.DHT, node: DHTNode, *, keys: list[str]) -> dict[str, dict[Any, Any]]:
    # sufficient_expiration_time=inf is what DHT.get(latest=True) means: search on instead of stopping at the first hit.
    # A few keys per search: a node answers all keys of a request in one message, which must stay under p2pd's limit.
    chunks = [keys[start:start + LOOKUP_KEYS_PER_REQUEST] for start in range(0, len(keys), LOOKUP_KEYS_PER_REQUEST)]
    found: dict[str, Any] = {}
    for part in await asyncio.gather(*(node.get_many(chunk, sufficient_expiration_time=math.inf) for chunk in chunks)):
        found.update(part)
    entries: dict[str, dict[Any, Any]] = {}
    for key, entry in found.items():
        # Only a subkey dictionary maps to ValueWithExpiration items; a plain value under a block key is garbage.
        if entry is not None and isinstance(entry.value, dict):
            entries[key] = {
                subkey: item.value for subkey, item in entry.value.items() if isinstance(item, ValueWithExpiration)
            }
    return entries


def _store_future(
    dht: hivemind.DHT, record: ServerRecord, keys: Iterable[str], expiration_time: float
) -> MPFuture[bool]:
    coroutine = partial(
        _store_under_keys,
        keys=list(keys),
        subkey=record.peer_id,
        value=record.to_wire(),
        expiration_time=expiration_time,
    )
    return dht.run_coroutine(coroutine, return_future=True)


def _records_by_block(
    model_id: str, num_blocks: int, entries: Mapping[str, Mapping[Any, Any]]
) -> list[dict[str, ServerRecord]]:
    return [
        _valid_records(model_id, block_index, entries.get(block_key(model_id, block_index), {}))
        for block_index in range(num_blocks)
    ]


def _valid_records(model_id: str, block_index: int, subkeys: Mapping[Any, Any]) -> dict[str, ServerRecord]:
    records: dict[str, ServerRecord] = {}
    for subkey, value in subkeys.items():
        record = ServerRecord.from_wire(value)
        if record is None:
            continue
        # Without this check any peer could announce another peer, or a stale record a range it gave up.
        if record.peer_id != subkey or record.model_id != model_id or block_index not in record.block_range:
            logger.debug(
                "dropping record of %r found under block %d, subkey %.100r", record.peer_id, block_index, subkey
            )
            continue
        records[record.peer_id] = record
    return records


def announce(
    dht: hivemind.DHT, record: ServerRecord, *, ttl_s: float, timeout_s: float = DEFAULT_DHT_TIMEOUT_S
) -> bool:
    """Gives whether `record` is now stored under every block it hosts, expiring in `ttl_s` (blocking)."""
    future = _store_future(dht, record, record_keys(record), get_dht_time() + ttl_s)
    try:
        return future.result(timeout=timeout_s)
    except FutureTimeoutError as error:
        raise RpcTimeout(f"DHT announce of {record.peer_id} did not finish within {timeout_s} s") from error


async def announce_async(
    dht: hivemind.DHT, record: ServerRecord, *, ttl_s: float, timeout_s: float = DEFAULT_DHT_TIMEOUT_S
) -> bool:
    """Gives whether `record` is now stored under every block it hosts, expiring in `ttl_s` (for asyncio code)."""
    return await _await_dht(_store_future(dht, record, record_keys(record), get_dht_time() + ttl_s), timeout_s)


def lookup(
    dht: hivemind.DHT, model_id: str, num_blocks: int, *, timeout_s: float = DEFAULT_DHT_TIMEOUT_S
) -> list[dict[str, ServerRecord]]:
    """Gives, for each block index, the valid records (peer_id -> record) announced for it (blocking)."""
    keys = [block_key(model_id, block_index) for block_index in range(num_blocks)]
    future = dht.run_coroutine(partial(_get_latest_subkeys, keys=keys), return_future=True)
    try:
        entries = future.result(timeout=timeout_s)
    except FutureTimeoutError as error:
        raise RpcTimeout(f"DHT lookup of {model_id!r} did not finish within {timeout_s} s") from error
    return _records_by_block(model_id, num_blocks, entries)


async def lookup_async(
    dht: hivemind.DHT, model_id: str, num_blocks: int, *, timeout_s: float = DEFAULT_DHT_TIMEOUT_S
) -> list[dict[str, ServerRecord]]:
    """Gives, for each block index, the valid records (peer_id -> record) announced for it (for asyncio code)."""
    keys = [block_key(model_id, block_index) for block_index in range(num_blocks)]
    future = dht.run_coroutine(partial(_get_latest_subkeys, keys=keys), return_future=True)
    return _records_by_block(model_id, num_blocks, await _await_dht(future, timeout_s))


async def lookup_servers_async(
    dht: hivemind.DHT, model_id: str, *, timeout_s: float = DEFAULT_DHT_TIMEOUT_S
) -> dict[str, ServerRecord]:
    """Gives the valid records (peer_id -> record) of every server of the model, with or without blocks yet."""
    return await _lookup_records(dht, servers_key(model_id), model_id, ServerRecord.from_wire, timeout_s)


RecordT = TypeVar("RecordT", ServerRecord, OrchestratorRecord)


async def _lookup_records(
    dht: hivemind.DHT, key: str, model_id: str, parse: Callable[[object], RecordT | None], timeout_s: float
) -> dict[str, RecordT]:
    """Gives the records under `key` that validate, are of `model_id` and sit under their own peer id's subkey."""
    future = dht.run_coroutine(partial(_get_latest_subkeys, keys=[key]), return_future=True)
    entries = (await _await_dht(future, timeout_s)).get(key, {})
    records: dict[str, RecordT] = {}
    for subkey, value in entries.items():
        record = parse(value)
        if record is not None and record.peer_id == subkey and record.model_id == model_id:
            records[record.peer_id] = record
    return records


def orchestrator_key(model_id: str) -> str:
    """Gives the DHT key under which the orchestrators of a model announce themselves."""
    return f"{model_id}.orchestrator"


async def announce_orchestrator_async(
    dht: hivemind.DHT, record: OrchestratorRecord, *, ttl_s: float, timeout_s: float = DEFAULT_DHT_TIMEOUT_S
) -> bool:
    """Gives whether the orchestrator's record is now stored, expiring in `ttl_s`."""
    coroutine = partial(
        _store_under_keys, keys=[orchestrator_key(record.model_id)], subkey=record.peer_id, value=record.to_wire(),
        expiration_time=get_dht_time() + ttl_s,
    )
    return await _await_dht(dht.run_coroutine(coroutine, return_future=True), timeout_s)


async def lookup_orchestrators_async(
    dht: hivemind.DHT, model_id: str, *, timeout_s: float = DEFAULT_DHT_TIMEOUT_S
) -> dict[str, OrchestratorRecord]:
    """Gives the valid, live orchestrator records (peer_id -> record) of a model."""
    return await _lookup_records(dht, orchestrator_key(model_id), model_id, OrchestratorRecord.from_wire, timeout_s)


async def lookup_block_async(
    dht: hivemind.DHT, model_id: str, block_index: int, *, timeout_s: float = DEFAULT_DHT_TIMEOUT_S
) -> dict[str, ServerRecord]:
    """Gives the valid records (peer_id -> record) announced for one block (for asyncio code)."""
    key = block_key(model_id, block_index)
    future = dht.run_coroutine(partial(_get_latest_subkeys, keys=[key]), return_future=True)
    entries = await _await_dht(future, timeout_s)
    return _valid_records(model_id, block_index, entries.get(key, {}))


async def _await_dht(future: MPFuture[T], timeout_s: float) -> T:
    try:
        # Shielded: cancelling this wait must not cancel hivemind's future, which it resolves from another
        # thread and would then log as an InvalidStateError.
        return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), timeout=timeout_s)
    except TimeoutError as error:
        raise RpcTimeout(f"DHT request did not finish within {timeout_s} s") from error


class Announcer:
    """Keeps one server's record on the DHT: re-announces `record_fn()` every `period_s`, marks it draining on stop.

    Lives on the caller's asyncio loop: `await start()` announces once and starts the refresh task;
    `await stop()` ends it and, with `drain=True`, stores a final `draining` record.
    """

    def __init__(
        self,
        dht: hivemind.DHT,
        record_fn: Callable[[], ServerRecord],
        *,
        period_s: float,
        ttl_s: float,
        drain_ttl_s: float = 10.0,
        timeout_s: float = DEFAULT_DHT_TIMEOUT_S,
    ) -> None:
        if not 0 < period_s < ttl_s:
            raise ValueError(f"need 0 < period_s < ttl_s so the record never lapses, got {period_s=} {ttl_s=}")
        check_record_ttl(ttl_s)
        if drain_ttl_s <= 0 or timeout_s <= 0:
            raise ValueError(f"drain_ttl_s and timeout_s must be positive, got {drain_ttl_s=} {timeout_s=}")
        self.dht = dht
        self.record_fn = record_fn
        self.period_s, self.ttl_s, self.drain_ttl_s, self.timeout_s = period_s, ttl_s, drain_ttl_s, timeout_s
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._keys_announced: set[str] = set()
        self._latest_expiration_time = -math.inf

    async def start(self) -> bool:
        """Gives whether the first announce stored every key; the refresh task runs either way."""
        if self._task is not None:
            raise RuntimeError("Announcer already started")
        try:
            announced = await self.announce_now()
        except RpcTimeout as error:
            logger.warning("first announce failed, will retry every %s s: %s", self.period_s, error)
            announced = False
        self._task = asyncio.create_task(self._refresh_forever(), name="swarm-announcer")
        return announced

    async def announce_now(self) -> bool:
        """Gives whether the current record was stored under every hosted block (e.g. right after a state change)."""
        return await self._store(self.record_fn(), get_dht_time() + self.ttl_s)

    async def stop(self, *, drain: bool = True) -> None:
        """Stops refreshing; with `drain`, stores a final `draining` record so clients stop routing here."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        if not drain:
            return
        record = self.record_fn().model_copy(update={"state": ServerState.draining})
        # hivemind rejects an entry that expires before the one it would replace, so a drain
        # record can be short-lived only down to the last announce's expiration.
        expiration_time = max(get_dht_time() + self.drain_ttl_s, self._latest_expiration_time + _EXPIRATION_EPSILON_S)
        try:
            if not await self._store(record, expiration_time):
                logger.warning("draining record of %s was not stored under every block", record.peer_id)
        except RpcTimeout as error:
            logger.warning("draining record of %s was not stored: %s", record.peer_id, error)

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            try:
                if not await self.announce_now():
                    logger.warning("announce did not store every key; retrying in %s s", self.period_s)
            except Exception:
                # A DHT hiccup or a failing record_fn must not end the refresh loop: the record would lapse.
                logger.warning("announce failed; retrying in %s s", self.period_s, exc_info=True)

    async def _store(self, record: ServerRecord, expiration_time: float) -> bool:
        async with self._lock:
            keys = record_keys(record)
            # Blocks no longer hosted get the new record too: it fails lookup's range check there,
            # so clients stop routing to them now instead of when the old entry expires.
            keys_dropped = sorted(self._keys_announced - set(keys))
            self._latest_expiration_time = max(self._latest_expiration_time, expiration_time)
            stored = await _await_dht(
                _store_future(self.dht, record, keys + keys_dropped, expiration_time), self.timeout_s
            )
            self._keys_announced = set(keys) if stored else self._keys_announced | set(keys)
            return stored
