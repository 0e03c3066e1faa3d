"""Signed DHT records (`swarm.signing`): only a peer stores under its own subkey, and no value outlives its signed
expiry. Unit checks of the validator, then a real server, `swarm-dht` and a forger on loopback."""

from __future__ import annotations

import dataclasses
import time
from functools import partial
from pathlib import Path
from typing import Any

import hivemind
import pytest
from hivemind.dht.validation import DHTRecord
from hivemind.p2p import P2P, PeerID
from hivemind.utils import get_dht_time
from hivemind.utils.serializer import MSGPackSerializer
from hypothesis import given, settings
from hypothesis import strategies as st

from client import ClientConfig
from client.swarm_client import SwarmClient
from swarm.dht import block_key, servers_key
from swarm.errors import IdentityError
from swarm.local_swarm import SwarmProcesses
from swarm.model import resolve_model
from swarm.records import ServerRecord, ServerState
from swarm.signing import SignedRecords, load_identity, open_dht
from tests.test_dropping import call, wait_for_ranges

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def identities(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("identities")
    paths = {name: folder / name for name in ("alice", "mallory")}
    for path in paths.values():
        P2P.generate_identity(str(path))
    return paths


def record(key: str, subkey: object, value: object, expiration: float) -> DHTRecord:
    return DHTRecord(MSGPackSerializer.dumps(key), MSGPackSerializer.dumps(subkey), MSGPackSerializer.dumps(value),
                     expiration)


def test_a_value_validates_only_under_its_signers_subkey_with_its_key_value_and_expiry(
    identities: dict[str, Path]
) -> None:
    alice, mallory = (SignedRecords(load_identity(identities[name])) for name in ("alice", "mallory"))
    assert alice.peer_id == PeerID.from_identity(identities["alice"].read_bytes()).to_base58()
    checker = SignedRecords()  # a client: checks, signs nothing
    plain = record("model/block/3", alice.peer_id, {"state": "online"}, get_dht_time() + 30)
    signed = dataclasses.replace(plain, value=alice.sign_value(plain))
    assert checker.validate(signed) and mallory.validate(signed)
    assert MSGPackSerializer.loads(checker.strip_value(signed)) == {"state": "online"}

    assert not checker.validate(plain)  # unsigned
    assert not checker.validate(dataclasses.replace(signed, expiration_time=signed.expiration_time + 60))  # replay
    assert not checker.validate(dataclasses.replace(signed, key=MSGPackSerializer.dumps("model/block/4")))
    assert not checker.validate(dataclasses.replace(signed, subkey=MSGPackSerializer.dumps(mallory.peer_id)))
    forged = record("model/block/3", alice.peer_id, {"state": "draining"}, get_dht_time() + 60)
    assert mallory.sign_value(forged) == forged.value  # nobody signs under another's subkey
    # mallory's own signature on a value under alice's subkey: its key is not alice's peer id
    mallorys = record("model/block/3", mallory.peer_id, {"state": "draining"}, get_dht_time() + 60)
    wrapped = mallory.sign_value(mallorys)
    assert not checker.validate(dataclasses.replace(forged, value=wrapped))
    assert not checker.validate(record("model/block/3", None, {"state": "online"}, get_dht_time() + 30))


@settings(max_examples=300, deadline=None)
@given(key=st.binary(max_size=64), subkey=st.binary(max_size=64), value=st.binary(max_size=2048),
       expiration=st.floats(allow_nan=True, allow_infinity=True))
def test_any_bytes_are_refused_without_an_exception(key: bytes, subkey: bytes, value: bytes,
                                                    expiration: float) -> None:
    checker = SignedRecords()
    junk = DHTRecord(key, subkey, value, expiration)
    assert checker.validate(junk) is False
    assert isinstance(checker.strip_value(junk), bytes)


def test_an_identity_that_is_not_an_rsa_key_is_refused_with_a_typed_error(tmp_path: Path) -> None:
    path = tmp_path / "garbage.key"
    path.write_bytes(b"\x08\x01\x12\x04abcd")  # a protobuf PrivateKey of type Ed25519
    with pytest.raises(IdentityError, match="Ed25519"):
        load_identity(path)
    path.write_bytes(b"not a key")
    with pytest.raises(IdentityError):
        load_identity(path)


async def _raw_store(_dht: hivemind.DHT, node: Any, *, keys: list[str], subkey: str, value: object,
                     expiration: float) -> list[bool]:
    stored = await node.store_many(keys, [value] * len(keys), expiration_time=expiration, subkeys=[subkey] * len(keys))
    return [bool(ok) for ok in stored.values()]


async def _raw_get(_dht: hivemind.DHT, node: Any, *, key: str) -> dict[Any, tuple[Any, float]]:
    found = await node.get(key, latest=True)
    if found is None or not isinstance(found.value, dict):
        return {}
    return {subkey: (item.value, item.expiration_time) for subkey, item in found.value.items()}


def servers_seen(client: SwarmClient) -> dict[str, ServerRecord]:
    return client.run(client.servers())


@pytest.mark.slow
def test_a_forged_or_replayed_record_is_refused_by_the_swarms_nodes_and_ignored_by_clients(
    swarm_factory: SwarmProcesses, tiny_llama: Path
) -> None:
    """A forger joins the DHT with an unchecked node and stores, under a running server's subkey, its record as
    `draining` with a later expiry: unsigned, then signed with the forger's own key. Both are refused. It then
    replays a record the server really signed, after the server dropped blocks: refused while a newer one exists,
    refused once its signed expiry passed, and refused with a fresh expiry (the signature covers it)."""
    swarm_factory.start_dht()
    model_id = resolve_model(str(tiny_llama)).model_id
    client = SwarmClient(model_id, 8, swarm_factory.initial_peers, ClientConfig())
    forger = hivemind.DHT(start=True, client_mode=True, initial_peers=swarm_factory.initial_peers)
    try:
        orchestrator = client.p2p.peer_id.to_base58()
        server = swarm_factory.start_server(tiny_llama, "0:8", "--orchestrator", orchestrator)
        wait_for_ranges(client, {server.peer_id: (0, 8)})
        original = servers_seen(client)[server.peer_id]
        raw = forger.run_coroutine(partial(_raw_get, key=block_key(model_id, 6)))
        old_value, old_expiration = raw[server.peer_id]  # the signed wrapper, as stored

        forged = original.model_copy(update={"state": ServerState.draining}).to_wire()
        keys = [servers_key(model_id), block_key(model_id, 0)]
        expiration = get_dht_time() + 600
        stored = forger.run_coroutine(partial(_raw_store, keys=keys, subkey=server.peer_id, value=forged,
                                              expiration=expiration))
        assert stored == [False, False]  # every node of the swarm refused it
        signed_by_forger = hivemind.DHT(start=True, client_mode=True, initial_peers=swarm_factory.initial_peers,
                                        record_validators=[SignedRecords(_fresh_key(swarm_factory.workdir))])
        try:
            stored = signed_by_forger.run_coroutine(partial(_raw_store, keys=keys, subkey=server.peer_id,
                                                            value=forged, expiration=expiration))
            assert stored == [False, False]
        finally:
            signed_by_forger.shutdown()
        time.sleep(2)  # several announce periods: the real record stays what clients see
        assert servers_seen(client)[server.peer_id].state == ServerState.online

        assert call(client, server.peer_id, "drop", {"blocks": [0, 4]})["blocks"] == [0, 4]
        wait_for_ranges(client, {server.peer_id: (0, 4)})
        replay = [block_key(model_id, 6)]
        stored = forger.run_coroutine(partial(_raw_store, keys=replay, subkey=server.peer_id, value=old_value,
                                              expiration=old_expiration))
        assert stored == [False]  # older than the record the server stored there since
        deadline = time.monotonic() + TIMEOUT_S
        while get_dht_time() < old_expiration + 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        for expiration in (old_expiration, get_dht_time() + 600):  # expired; then with an expiry it did not sign
            stored = forger.run_coroutine(partial(_raw_store, keys=replay, subkey=server.peer_id, value=old_value,
                                                  expiration=expiration))
            assert stored == [False]
        records = client.run(client.servers())
        assert (records[server.peer_id].block_start, records[server.peer_id].block_end) == (0, 4)
        assert not any(peer == server.peer_id for peer in _block_hosts(client, 6))
    finally:
        forger.shutdown()
        client.shutdown()


def _block_hosts(client: SwarmClient, block: int) -> set[str]:
    from swarm.dht import lookup_block_async

    found = client.run(lookup_block_async(client.dht, client.model_id, block, timeout_s=TIMEOUT_S))
    return set(found)


def _fresh_key(folder: Path) -> Any:
    path = folder / f"mallory-{time.monotonic_ns()}.key"
    P2P.generate_identity(str(path))
    return load_identity(path)


def test_open_dht_runs_as_its_identity_and_makes_one_when_none_is_given(tmp_path: Path) -> None:
    path = tmp_path / "server.key"
    dht = open_dht(identity=path, host_maddrs=LOOPBACK)  # created, then used
    try:
        assert dht.peer_id == PeerID.from_identity(path.read_bytes())
    finally:
        dht.shutdown()
    again = open_dht(identity=path, host_maddrs=LOOPBACK)
    try:
        assert again.peer_id == PeerID.from_identity(path.read_bytes())  # a stable peer id
    finally:
        again.shutdown()
