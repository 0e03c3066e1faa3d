"""Bounds on what the swarm's DHT nodes store and what one lookup reads, so that a flooded key costs bounded work.

Anyone can join the DHT. Signatures (`swarm.signing`) stop a peer from writing under another peer's subkey, but not
from writing thousands of subkeys of its own identities, or values at the size limit. Unbounded, such a flood grows
every node's storage, and a node's answer for the flooded key outgrows p2pd's message limit (4 MiB): the answer
fails as a whole and the honest records in it stop routing. The bounds:
- `RecordShape`, a record validator: a value (unwrapped from its signature) is a server or orchestrator record of
  the peer whose subkey it sits under, at most `MAX_RECORD_BYTES`, expiring at most `MAX_RECORD_TTL_S` from now.
  Nodes refuse to store anything else, and a lookup drops it.
- `BoundedStorage`: a node keeps at most `MAX_KEY_BYTES` of values under one key (about 90 servers at a real record's
  1.3 KiB signed, 20 at the size bound). A full key refuses new subkeys and still takes refreshes of the ones it
  holds, so the servers announced before a flood keep routing. (Evicting the entry that expires first, hivemind's
  rule for a full storage, would hand the key to whoever announces with the longest TTL.) New subkeys stop
  `KEY_RESERVE_BYTES` short of the budget, which leaves room for held records to grow a little when refreshed; a
  refresh that does not grow its record is always taken. A slot frees when its entry expires: at most
  `MAX_RECORD_TTL_S` after its peer stopped refreshing it.
- `NoCache`: a node caches no lookups, and takes no cache entries from other nodes.
- `LOOKUP_KEYS_PER_REQUEST`: a node answers all keys of a request in one message, so a lookup asks for at most so
  many keys per search that the answer, every key at its budget, fits in half the message limit (16: a 30-block
  model's blocks take two searches).
So an honest node's answer is at most 2 MiB, and a lookup checks at most about 90 signatures per key and honest node.
A hostile node's answer is bounded by the message limit, and the first value in it that fails validation discards
it whole (hivemind's rule). Left open: identities that take a key's free budget keep a new server from announcing on
the nodes that hold it, for as long as they refresh (a Sybil attack; it needs a cost per identity, which the swarm
has not yet).
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
MAX_KEY_BYTES = 128 << 10  # values (with ENTRY_OVERHEAD each) a node keeps under one key
KEY_RESERVE_BYTES = 16 << 10  # the end of that budget, kept for refreshes of held records that grow
ENTRY_OVERHEAD = 64  # bytes an entry costs beside its value in an answer: subkey, expiry, framing
LOOKUP_KEYS_PER_REQUEST = max(1, MAX_UNARY_PAYLOAD_SIZE // MAX_KEY_BYTES)


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
    """hivemind's local storage with at most `MAX_KEY_BYTES` of values under any key: a full key refuses new
    subkeys and takes refreshes of those it holds."""

    def store_subkey(self, key: Any, subkey: Any, value: bytes, expiration_time: DHTExpiration) -> bool:
        previous = self.get(key)
        if previous is not None and isinstance(previous.value, DictionaryDHTValue):
            held = previous.value.get(subkey)
            total = key_bytes(previous.value)
            size = len(value) + ENTRY_OVERHEAD
            if held is None and total + size > MAX_KEY_BYTES - KEY_RESERVE_BYTES:
                return False
            if held is not None:
                held_size = len(held.value) + ENTRY_OVERHEAD
                if size > held_size and total - held_size + size > MAX_KEY_BYTES:
                    return False
        return super().store_subkey(key, subkey, value, expiration_time)


def key_bytes(subkeys: DictionaryDHTValue) -> int:
    """Gives what the entries under one key cost against `MAX_KEY_BYTES`."""
    return sum(len(item.value) + ENTRY_OVERHEAD for _subkey, item in subkeys.items())


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
