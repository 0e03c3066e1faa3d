"""Typed errors that cross the wire intact: each has a stable code and a message a user can act on."""

from __future__ import annotations

from typing import ClassVar


class SwarmError(Exception):
    """Base of every error a peer may send to another; `code` names the class on the wire."""

    code: ClassVar[str] = "SwarmError"
    _registry: ClassVar[dict[str, type[SwarmError]]] = {}

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        cls.code = cls.__name__
        SwarmError._registry[cls.code] = cls

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def to_wire(self) -> dict[str, str]:
        """Gives the frame payload that carries this error."""
        return {"code": self.code, "message": self.message}

    @staticmethod
    def from_wire(payload: object) -> SwarmError:
        """Rebuilds the typed error a peer sent; unknown codes become a plain `RemoteError`."""
        if not isinstance(payload, dict):
            return MalformedFrame(f"error payload is not a map: {payload!r:.200}")
        code, message = str(payload.get("code", "")), str(payload.get("message", ""))
        cls = SwarmError._registry.get(code)
        if cls is None:
            return RemoteError(f"{code}: {message}")
        return cls(message)


SwarmError._registry["SwarmError"] = SwarmError


class RemoteError(SwarmError):
    """A peer failed with an error this version does not know."""


class MalformedFrame(SwarmError):
    """A frame could not be decoded (bad msgpack, missing fields, wrong types)."""


class FrameTooLarge(SwarmError):
    """A frame exceeds the size limit agreed for this connection."""


class InvalidTensor(SwarmError):
    """A tensor has a dtype, shape or byte count that the receiver cannot accept."""


class UnknownMethod(SwarmError):
    """The peer does not serve the requested RPC method."""


class SessionNotFound(SwarmError):
    """The inference session is unknown, closed or timed out on this server."""


class MaxLengthExceeded(SwarmError):
    """A session would grow past its reserved max length (or the server's limit)."""


class ServerBusy(SwarmError):
    """The server has no free pages for the requested session right now."""


class BlocksNotHosted(SwarmError):
    """The requested block range is not (entirely) hosted by this server."""


class ServerDraining(SwarmError):
    """The server is shutting down and accepts no new sessions or steps."""


class UnsupportedArchitecture(SwarmError):
    """The model's architecture has no adapter in swarm.model."""


class InvalidBlockRange(SwarmError, ValueError):
    """A block range such as `--blocks a:b` cannot be parsed or is out of bounds."""


class OutOfPages(SwarmError):
    """The memory pool cannot satisfy an allocation."""


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


class AssignmentRefused(SwarmError):
    """A server refused a block assignment: it names no orchestrator, or another one than the sender."""
