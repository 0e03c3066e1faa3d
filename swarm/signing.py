"""Signed DHT records: only a peer can store a value under its own subkey, and nobody can make it outlive its expiry.

Every value chainswarm stores in the DHT sits under a key (a block, the servers of a model, its orchestrators) and
a subkey that is the storing peer's id. `SignedRecords`, a hivemind record validator (the DHT's own hook, called on
every store a node accepts and on every value a lookup receives), makes that binding cryptographic:
- `sign_value`: a value this peer stores under its own subkey is wrapped as `[TAG, value, public key, signature]`,
  the signature (RSA PKCS#1 v1.5, SHA-256) covering the key, the subkey, the value and the expiration time;
- `validate`: a value is accepted only under a subkey that is a peer id, wrapped, with a public key whose libp2p
  peer id (the SHA-256 multihash of the key, libp2p's rule for RSA) is that subkey, and a signature that verifies;
  anything else (no subkey, another peer's key, a changed value or expiry, no signature) is refused. A node refuses
  to store it, a lookup drops it;
- `strip_value` unwraps it for the application.
A replayed old value keeps its signed expiry: the DHT drops it once that passed, and before that a newer value of the
same peer (a later expiry) wins.

The key is the peer's libp2p identity: hivemind's p2pd identities are RSA keys (`P2P.generate_identity`), kept in a
file (`--identity`, or one made for the process's lifetime: `open_dht`). hivemind's `RSASignatureValidator` is not
used: it protects keys that embed an OpenSSH-encoded key of its own (`[owner:ssh-rsa ...]`), unrelated to the peer
id, so it cannot tie a subkey to the peer that announced it; this validator checks the peer id itself, with no
registry, because a libp2p peer id is the hash of its public key.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import shutil
import tempfile
from collections import OrderedDict
from pathlib import Path
from typing import Any

import hivemind
import multihash
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from google.protobuf.message import DecodeError
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p import P2P, PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.serializer import MSGPackSerializer

from swarm.dht_limits import MAX_VALUE_BYTES, RecordShape, install_bounded_storage
from swarm.errors import IdentityError

log = logging.getLogger(__name__)

TAG = "chainswarm-signed-1"
MAX_PUBLIC_KEY_BYTES = 1100  # DER of an RSA key up to 8192 bits
KEY_CACHE = 1024  # public keys kept parsed


def load_identity(path: Path) -> rsa.RSAPrivateKey:
    """Gives the RSA private key of a libp2p identity file (hivemind's `P2P.generate_identity` format)."""
    try:
        key = crypto_pb2.PrivateKey.FromString(path.read_bytes())
    except (OSError, DecodeError) as error:
        raise IdentityError(f"cannot read identity {path}: {error}") from None
    if key.key_type != crypto_pb2.KeyType.RSA:
        raise IdentityError(f"identity {path} holds a {crypto_pb2.KeyType.Name(key.key_type)} key; chainswarm signs "
                            f"records with RSA identities, as hivemind's p2pd makes them")
    try:
        private_key = serialization.load_der_private_key(key.data, password=None)
    except (ValueError, TypeError) as error:
        raise IdentityError(f"identity {path} holds no readable RSA key: {error}") from None
    if not isinstance(private_key, rsa.RSAPrivateKey):
        raise IdentityError(f"identity {path} does not hold an RSA key")
    return private_key


def peer_id_of(public_key: rsa.RSAPublicKey) -> PeerID:
    """Gives the libp2p peer id of an RSA public key: the SHA-256 multihash of its protobuf encoding."""
    der = public_key.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    encoded = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    return PeerID(multihash.encode(hashlib.sha256(encoded).digest(), multihash.coerce_code("sha2-256")))


def _signed_bytes(record: DHTRecord, value: bytes) -> bytes:
    return MSGPackSerializer.dumps([TAG, record.key, record.subkey, value, record.expiration_time])


class SignedRecords(RecordValidatorBase):
    """Signs this peer's values (with `private_key`) and accepts only values their subkey's peer signed."""

    def __init__(self, private_key: rsa.RSAPrivateKey | None = None) -> None:
        self._private_key = private_key
        self.peer_id: str | None = None
        self._public_der = b""
        if private_key is not None:
            public_key = private_key.public_key()
            self.peer_id = peer_id_of(public_key).to_base58()
            self._public_der = public_key.public_bytes(serialization.Encoding.DER,
                                                       serialization.PublicFormat.SubjectPublicKeyInfo)
        self._own_subkey = MSGPackSerializer.dumps(self.peer_id) if self.peer_id else None
        self._keys: OrderedDict[bytes, tuple[rsa.RSAPublicKey, str]] = OrderedDict()  # DER -> (key, peer id)

    def sign_value(self, record: DHTRecord) -> bytes:
        """Wraps a value this peer stores under its own subkey with its public key and signature."""
        if self._private_key is None or record.subkey != self._own_subkey:
            return record.value  # not ours to sign: nodes refuse it
        signature = self._private_key.sign(_signed_bytes(record, record.value), padding.PKCS1v15(), hashes.SHA256())
        return MSGPackSerializer.dumps([TAG, record.value, self._public_der, signature])

    def validate(self, record: DHTRecord) -> bool:
        """Gives whether the subkey's peer signed this value, for this key and expiry."""
        unwrapped = _unwrap(record.value)
        if unwrapped is None:
            return False
        value, public_der, signature = unwrapped
        try:
            subkey = MSGPackSerializer.loads(record.subkey) if record.subkey else None
        except Exception:  # msgpack raises several unrelated types for corrupt input
            return False
        if not isinstance(subkey, str):
            return False
        found = self._public_key(public_der)
        if found is None or found[1] != subkey:
            return False
        try:
            found[0].verify(signature, _signed_bytes(record, value), padding.PKCS1v15(), hashes.SHA256())
        except InvalidSignature:
            return False
        return True

    def strip_value(self, record: DHTRecord) -> bytes:
        unwrapped = _unwrap(record.value)
        return record.value if unwrapped is None else unwrapped[0]

    def _public_key(self, der: bytes) -> tuple[rsa.RSAPublicKey, str] | None:
        cached = self._keys.get(der)
        if cached is not None:
            self._keys.move_to_end(der)
            return cached
        try:
            public_key = serialization.load_der_public_key(der)
        except (ValueError, TypeError):
            return None
        if not isinstance(public_key, rsa.RSAPublicKey):
            return None
        found = (public_key, peer_id_of(public_key).to_base58())
        self._keys[der] = found
        while len(self._keys) > KEY_CACHE:
            self._keys.popitem(last=False)
        return found

    @property
    def priority(self) -> int:
        return 10  # signs last and checks first: the value it signs is what the other validators made


def _unwrap(value: bytes) -> tuple[bytes, bytes, bytes] | None:
    """Gives (value, public key DER, signature) of a signed value, or None for anything else."""
    if len(value) > MAX_VALUE_BYTES:
        return None
    try:
        parts: Any = MSGPackSerializer.loads(value)
    except Exception:  # msgpack raises several unrelated types for corrupt input
        return None
    if (not isinstance(parts, list) or len(parts) != 4 or parts[0] != TAG
            or not all(isinstance(part, bytes) for part in parts[1:]) or len(parts[2]) > MAX_PUBLIC_KEY_BYTES):
        return None
    return parts[1], parts[2], parts[3]


def open_dht(*, identity: Path | None = None, sign: bool = True, **kwargs: Any) -> hivemind.DHT:
    """Gives a started hivemind DHT whose records are signed and checked (`SignedRecords`), and whose storage and
    records are bounded (`swarm.dht_limits`). With `sign`, it stores
    under its libp2p identity, `identity` (created if missing) or one made for this process's lifetime; without, it
    only checks what it finds (a client)."""
    private_key = None
    if sign:
        if identity is None:
            folder = tempfile.mkdtemp(prefix="chainswarm-identity-")
            atexit.register(shutil.rmtree, folder, ignore_errors=True)
            identity = Path(folder) / "identity.key"
        if not identity.exists():
            P2P.generate_identity(str(identity))
        private_key = load_identity(identity)
        kwargs["identity_path"] = str(identity)
    validator = SignedRecords(private_key)
    kwargs.setdefault("cache_nearest", 0)  # no node caches (`dht_limits.NoCache`): pushing entries there is waste
    dht = hivemind.DHT(record_validators=[validator, RecordShape()], start=True, **kwargs)
    if validator.peer_id is not None and validator.peer_id != dht.peer_id.to_base58():
        dht.shutdown()
        raise IdentityError(f"the DHT runs as {dht.peer_id} but the identity's key is {validator.peer_id}")
    dht.run_coroutine(install_bounded_storage)
    return dht
