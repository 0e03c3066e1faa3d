"""OpenAI error objects: `{"error": {"message", "type", "param", "code"}}` with the HTTP status OpenAI uses."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from swarm.errors import MaxLengthExceeded, NoRouteFound, RpcTimeout, ServerBusy, SwarmError

RETRY_AFTER_S = 5


@dataclass
class ApiError(Exception):
    """An error an HTTP request ends with."""

    status: int
    message: str
    type: str
    param: str | None = None
    code: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param=param)


def unknown_model(name: str) -> ApiError:
    return ApiError(404, f"The model {name!r} does not exist on this swarm", "invalid_request_error", param="model",
                    code="model_not_found")


def unavailable(message: str) -> ApiError:
    return ApiError(503, message, "service_unavailable", code="no_capacity",
                    headers={"Retry-After": str(RETRY_AFTER_S)})


def timed_out(seconds: float) -> ApiError:
    return ApiError(504, f"the swarm did not answer within {seconds:g} s", "timeout", code="timeout")


def from_swarm(error: Exception) -> ApiError:
    """Gives the HTTP error of a failed generation."""
    name = type(error).__name__
    if isinstance(error, NoRouteFound | ServerBusy):
        return unavailable(f"{name}: {error}")
    if isinstance(error, RpcTimeout):
        return ApiError(504, f"{name}: {error}", "timeout", code="timeout")
    if isinstance(error, MaxLengthExceeded):
        return bad_request(f"{name}: {error}", param="max_tokens")
    if isinstance(error, SwarmError):
        return ApiError(502, f"{name}: {error}", "server_error", code="swarm_error")
    return ApiError(500, f"{name}: {error}", "server_error")
