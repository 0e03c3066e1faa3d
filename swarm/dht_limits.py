"""Bounds on what the swarm's DHT nodes store and what one lookup reads, so that a flooded key costs bounded work.

Anyone can join the DHT. Signatures (`swarm.signing`) stop a peer from writing under another peer's subkey, but not
from writing thousands of subkeys of its own identities, or values at the size limit. Unbounded, such a flood grows
every node's storage, and a node's answer for the flooded key outgrows p2pd's message limit (4 MiB): the answer
fails as a whole and the honest records in it stop routing. The bounds:
- `RecordShape`, a record validator: a value (unwrapped from its signature) is a server or orchestrator record of
  the peer whose subkey it sits under, at most `MAX_RECORD_BYTES`, expiring at most `MAX_RECORD_TTL_S` from now.
  Nodes refuse to store anything else, and a lookup drops it.
- `BoundedStorage`: a node keeps at most `MAX_SUBKEYS_PER_KEY` subkeys under one key. A full key refuses new
  subkeys and still takes refreshes of the ones it holds, so the servers announced before a flood keep routing
  (evicting the entry that expires first, hivemind's rule for a full storage, would hand the key to whoever
  announces with the longest TTL). A slot frees when its entry expires: at most `MAX_RECORD_TTL_S` after its peer
  stopped refreshing it.
- `NoCache`: a node caches no lookups, and takes no cache entries from other nodes.
- `LOOKUP_KEYS_PER_REQUEST`: a lookup asks for so few keys per request that a node's whole answer, every key at its
  bounds, fits in half the message limit.
So an honest node's answer is at most about 1 MiB per key and a lookup checks at most `MAX_SUBKEYS_PER_KEY`
signatures per key and honest node. A hostile node's answer is bounded by the message limit, and the first value in
it that fails validation discards it whole (hivemind's rule). Left open: `MAX_SUBKEYS_PER_KEY` identities that take
a key's free slots keep a new server from announcing on the nodes that hold it, for as long as they refresh (a Sybil
attack; it needs a cost per identity, which the swarm has not yet).
"""

from __future__ import annotations

from typing import Any

import hivemind
from hivemind.dht import DHTNode
from hivemind.dht.storage import DHTLocalStorage, DictionaryDHTValue
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p.p2p_daemon_bindings.control import MAX_UNARY_PAYLOAD_SIZE
from hivemind.utils import get_dht_time
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.timed_storage import MAX_DHT_TIME_DISCREPANCY_SECONDS, DHTExpiration

from swarm.records import OrchestratorRecord, ServerRecord

MAX_RECORD_BYTES = 7 << 10  # a record at every field's bound packs to about 5.8 KiB; real ones to under 1 KiB
MAX_VALUE_BYTES = 8 << 10  # the same, signed: public key and signature add about 600 bytes
MAX_RECORD_TTL_S = 600.0  # the longest a record may live unrefreshed; servers and orchestrators default to 30 s
MAX_SUBKEYS_PER_KEY = 128  # servers of one block (or of one model) a node keeps
LOOKUP_KEYS_PER_REQUEST = max(1, MAX_UNARY_PAYLOAD_SIZE // (MAX_SUBKEYS_PER_KEY * MAX_VALUE_BYTES))


def check_record_ttl(ttl_s: float) -> None:
    """Raises ValueError unless a record announced with `ttl_s` is one the swarm's nodes store."""
    if not 0 < ttl_s <= MAX_RECORD_TTL_S:
        raise ValueError(f"a record's TTL must be in (0, {MAX_RECORD_TTL_S:.0f}] s, got {ttl_s}")


class RecordShape(RecordValidatorBase):
    """Accepts only a server or orchestrator record of the subkey's peer, of bounded size and lifetime."""

    def validate(self, record: DHTRecord) -> bool:
        if len(record.value) > MAX_RECORD_BYTES:
            return False
        if not record.expiration_time <= get_dht_time() + MAX_RECORD_TTL_S + MAX_DHT_TIME_DISCREPANCY_SECONDS:
            return False  # also refuses NaN
        try:
            subkey, value = MSGPackSerializer.loads(record.subkey), MSGPackSerializer.loads(record.value)
        except Exception:  # msgpack raises several unrelated types for corrupt input
            return False
        if not isinstance(subkey, str) or not isinstance(value, dict):
            return False
        parsed = ServerRecord.from_wire(value) if "block_start" in value else OrchestratorRecord.from_wire(value)
        return parsed is not None and parsed.peer_id == subkey

    @property
    def priority(self) -> int:
        return 5  # below `SignedRecords`: it sees the value the signature wrapped


class BoundedStorage(DHTLocalStorage):
    """hivemind's local storage with at most `MAX_SUBKEYS_PER_KEY` subkeys under any key: a full key refuses new
    subkeys and takes refreshes of those it holds."""

    def store_subkey(self, key: Any, subkey: Any, value: bytes, expiration_time: DHTExpiration) -> bool:
        previous = self.get(key)
        if (previous is not None and isinstance(previous.value, DictionaryDHTValue)
                and subkey not in previous.value and len(previous.value) >= MAX_SUBKEYS_PER_KEY):
            return False
        return super().store_subkey(key, subkey, value, expiration_time)


class NoCache(DHTLocalStorage):
    """A node cache that keeps nothing. hivemind's cache holds lookups' merged answers and what other nodes push
    `in_cache`, unbounded per key, and a node answers from it instead of its storage when it expires later: a
    pushed cache entry of a flood's records alone would hide the honest ones."""

    def store(self, key: Any, value: Any, expiration_time: DHTExpiration, subkey: Any = None) -> bool:
        return False

    def store_subkey(self, key: Any, subkey: Any, value: bytes, expiration_time: DHTExpiration) -> bool:
        return False


async def install_bounded_storage(_dht: hivemind.DHT, node: DHTNode) -> None:
    """Swaps the node's storage for a bounded one that holds what it held, and its cache for none (runs in the
    DHT's process)."""
    protocol = node.protocol
    storage = BoundedStorage()
    for key, item in protocol.storage.items():
        storage.store(key, item.value, item.expiration_time)
    protocol.storage, protocol.cache = storage, NoCache()
