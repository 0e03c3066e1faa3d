"""Typed errors that cross the wire intact: each has a stable code and a message a user can act on."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise
from typing import ClassVar

MAX_DETAIL_KEYS = 8
MAX_DETAIL_CHARS = 256
MAX_DETAIL_LIST = 16
Detail = str | int | list[str]


class SwarmError(Exception):
    """Base of every error a peer may send to another; `code` names the class on the wire."""

    code: ClassVar[str] = "SwarmError"
    _registry: ClassVar[dict[str, type[SwarmError]]] = {}

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        cls.code = cls.__name__
        SwarmError._registry[cls.code] = cls

    def __init__(self, message: str, details: dict[str, Detail] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.details: dict[str, Detail] = dict(details or {})  # what a program acts on (e.g. where a session went)

    def to_wire(self) -> dict[str, object]:
        """Gives the frame payload that carries this error."""
        wire: dict[str, object] = {"code": self.code, "message": self.message}
        if self.details:
            wire["details"] = self.details
        return wire

    @staticmethod
    def from_wire(payload: object) -> SwarmError:
        """Rebuilds the typed error a peer sent; unknown codes become a plain `RemoteError`. Details that are not
        a small map of strings, integers and lists of strings are dropped."""
        if not isinstance(payload, dict):
            return MalformedFrame(f"error payload is not a map: {payload!r:.200}")
        code, message = str(payload.get("code", "")), str(payload.get("message", ""))
        cls = SwarmError._registry.get(code)
        if cls is None:
            return RemoteError(f"{code}: {message}")
        return cls(message, _valid_details(payload.get("details")))


def _valid_details(details: object) -> dict[str, Detail]:
    if not isinstance(details, dict) or len(details) > MAX_DETAIL_KEYS:
        return {}
    valid: dict[str, Detail] = {}
    for key, value in details.items():
        if not isinstance(key, str) or len(key) > MAX_DETAIL_CHARS:
            return {}
        if (isinstance(value, str) and len(value) <= MAX_DETAIL_CHARS) or isinstance(value, int):
            valid[key] = value
        elif isinstance(value, list) and len(value) <= MAX_DETAIL_LIST and all(
            isinstance(item, str) and len(item) <= MAX_DETAIL_CHARS for item in value
        ):
            valid[key] = list(value)
        else:
            return {}
    return valid


SwarmError._registry["SwarmError"] = SwarmError


class RemoteError(SwarmError):
    """A peer failed with an error this version does not know."""


class MalformedFrame(SwarmError):
    """A frame could not be decoded (bad msgpack, missing fields, wrong types)."""


class FrameTooLarge(SwarmError):
    """A frame exceeds the size limit agreed for this connection."""


class UnknownCompression(MalformedFrame, ValueError):
    """A compression name other than none, fp16 or bf16 (in a request, or given to `encode_tensor`)."""


class InvalidTensor(SwarmError):
    """A tensor has a dtype, shape or byte count that the receiver cannot accept."""


class UnknownMethod(SwarmError):
    """The peer does not serve the requested RPC method."""


class SessionNotFound(SwarmError):
    """The inference session is unknown, closed or timed out on this server."""


class MaxLengthExceeded(SwarmError):
    """A session would grow past its reserved max length (or the server's limit)."""


class ServerBusy(SwarmError):
    """The server has no free pages for the requested session right now. A server that expects room soon (pages a
    drop is freeing) says when to ask again: `details["retry_after_ms"]`, read by `retry_after_s`."""

    @property
    def retry_after_s(self) -> float | None:
        """Gives when the server asked to be tried again (s), or None if it named no time."""
        ms = self.details.get("retry_after_ms")
        return ms / 1000 if isinstance(ms, int) and ms > 0 else None


class QuotaExceeded(ServerBusy):
    """The client already holds as many sessions or KV pages on this server as one client may: its routing treats
    it like a full server (go elsewhere, or wait)."""


class BlocksNotHosted(SwarmError):
    """The requested block range is not (entirely) hosted by this server. A server says which blocks it takes new
    sessions on now (`details["block_start"]`, `details["block_end"]`, read by `hosted`): its record in the DHT may
    still show the range it served before a change."""

    @property
    def hosted(self) -> tuple[int, int] | None:
        """Gives the [start, end) the server said it serves for new sessions, or None if it named none."""
        start, end = self.details.get("block_start"), self.details.get("block_end")
        if isinstance(start, int) and isinstance(end, int) and 0 <= start <= end:
            return start, end
        return None


class BlocksDropped(SwarmError):
    """The server dropped blocks this session used, to free their pages for KV (KunServe); the session continues
    on a chain through the servers that keep those blocks, replayed from the client's saved inputs."""


class StepStopped(SwarmError):
    """The server stopped a step of several tokens before its end, where the batch computing it ended: a drop moves
    the session's blocks (KunServe's exchange), and the rest of the step computes on the new chain. The session
    stays at the step's start; the server answers the step again once the move is done (`ChainChanged`), so a
    client sees this only if that failed (drops stopped the same step again and again), and replays the session."""


class ServerDraining(SwarmError):
    """The server is shutting down and accepts no new sessions or steps."""


class UnsupportedArchitecture(SwarmError):
    """The model's architecture has no adapter in swarm.model."""


class InvalidBlockRange(SwarmError, ValueError):
    """A block range such as `--blocks a:b` cannot be parsed or is out of bounds."""


class OutOfPages(SwarmError):
    """The memory pool cannot satisfy an allocation."""


class IdentityError(SwarmError):
    """An identity file that holds no RSA private key in libp2p's protobuf format (records are signed with it)."""


class WrongOutput(SwarmError):
    """A server's outputs differed from other servers' for the same blocks and inputs beyond the tolerance of their
    dtypes (a client's spot-check); without a third server to tell which one is right, the step cannot be trusted."""


class RpcTimeout(SwarmError):
    """A peer did not answer within the call's timeout."""


class PeerUnreachable(SwarmError):
    """A connection to a peer could not be opened or was lost."""


class NoRouteFound(SwarmError):
    """No chain of online servers covers the requested blocks."""


class InternalServerError(SwarmError):
    """A peer's handler failed with an unexpected exception; the message names its type and text."""


class StepNotPushed(SwarmError):
    """A step the client expected the previous server to push did not arrive in time; send it with its input."""


class PositionMismatch(SwarmError):
    """A step names a start position other than the session's current one."""


class MigrationRefused(SwarmError):
    """A server refused to move a session: the caller is neither the session's client nor its orchestrator, or a
    lender of a victim's KV that does not announce its blocks."""


class AssignmentRefused(SwarmError):
    """A server refused a block assignment: it names no orchestrator, or another one than the sender."""


class SessionMoved(SwarmError):
    """The session migrated to another server (`details`: `peer_id`, the server's `addrs`, `mode`): with its KV
    cache (mode "kv"), send its steps there without a replay; in mode "replay", open it there and replay."""

    @classmethod
    def to(cls, session_id: str, peer_id: str, addrs: list[str], *, mode: str = "kv") -> SessionMoved:
        how = "continue there" if mode == "kv" else "open it there and replay its inputs"
        return cls(f"session {session_id!r} moved to server {peer_id}; {how}",
                   {"peer_id": peer_id, "addrs": addrs[:MAX_DETAIL_LIST], "mode": mode})

    @property
    def replay(self) -> bool:
        """Gives whether the session's KV stayed behind: the client opens it anew there and replays its inputs."""
        return self.details.get("mode") == "replay"

    @property
    def peer_id(self) -> str | None:
        value = self.details.get("peer_id")
        return value if isinstance(value, str) else None

    @property
    def addrs(self) -> list[str]:
        value = self.details.get("addrs")
        return list(value) if isinstance(value, list) else []


@dataclass(frozen=True)
class Hop:
    """One server's part of a session whose chain changed: blocks [start, end) of it run on `peer_id` under
    `session_id`."""

    peer_id: str
    start: int
    end: int
    session_id: str

    def to_text(self) -> str:
        return f"{self.peer_id} {self.start} {self.end} {self.session_id}"

    @staticmethod
    def from_text(text: str) -> Hop | None:
        parts = text.split(" ", 3)
        if len(parts) != 4 or not parts[1].isdigit() or not parts[2].isdigit() or not parts[0] or not parts[3]:
            return None
        return Hop(parts[0], int(parts[1]), int(parts[2]), parts[3])


class ChainChanged(SwarmError):
    """The server split or merged this session's blocks with a peer's, its KV with them, at a step boundary (KunServe's
    drop exchange and restore): `details` give the `hops` that now run the blocks [hops[0].start, hops[-1].end) of
    the session, in order, and the `position` they are all at. The client points its chain at them and sends the
    step again, without a replay."""

    @classmethod
    def to(cls, hops: list[Hop], position: int) -> ChainChanged:
        route = " -> ".join(f"{hop.peer_id}[{hop.start}:{hop.end}]" for hop in hops)
        return cls(f"the session's blocks {hops[0].start}:{hops[-1].end} now run on {route} at position {position}; "
                   f"send the step there", {"hops": [hop.to_text() for hop in hops[:MAX_DETAIL_LIST]],
                                            "position": position})

    @property
    def hops(self) -> list[Hop]:
        """Gives the hops, in block order; empty if they do not tile a range (a malformed error)."""
        value = self.details.get("hops")
        hops = [Hop.from_text(item) for item in value] if isinstance(value, list) else []
        if not hops or any(hop is None or hop.start >= hop.end for hop in hops):
            return []
        valid = [hop for hop in hops if hop is not None]
        return valid if all(a.end == b.start for a, b in pairwise(valid)) else []

    @property
    def position(self) -> int:
        value = self.details.get("position")
        return value if isinstance(value, int) else -1
