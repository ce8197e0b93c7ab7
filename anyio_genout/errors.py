"""The exceptions anyio-genout raises: one tree under :class:`GenoutError`.

Two families:

* :class:`UsageError`: the caller asked for something invalid (a bad request, a duplicate
  id). Nothing was sent; fix the call.
* :class:`OperationalError`: something outside the caller went wrong (the engine died, a peer
  sent garbage, the client was closed). The client's health accessors say whether it can still
  be used.

No ``zmq.ZMQError``, msgpack exception or ``ExceptionGroup`` escapes the public API: each is
translated into one of these.

This module imports nothing but the standard library, so the sans-IO protocol core can use it.
"""

from __future__ import annotations

__all__ = [
    "ClientClosedError",
    "DuplicateRequestIdError",
    "EngineDeadError",
    "GenoutError",
    "HandshakeError",
    "HandshakeTimeoutError",
    "IncompleteStreamError",
    "InconsistentUtilityResultsError",
    "InvalidRequestError",
    "OperationalError",
    "ProtocolError",
    "RequestStreamClosed",
    "SamplingMaskMismatchError",
    "TransportError",
    "UnsupportedVersionError",
    "UsageError",
    "UtilityCallError",
]


class GenoutError(Exception):
    """Base class of every error anyio-genout raises on purpose."""


class UsageError(GenoutError):
    """The caller asked for something invalid; nothing was sent to any engine."""


class OperationalError(GenoutError):
    """Something outside the caller failed: an engine, the network, a peer."""


class InvalidRequestError(UsageError, ValueError):
    """A request field is invalid. ``field`` names it (dotted for nested fields)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"invalid request: {field}: {message}")
        self.field = field
        self.message = message


class DuplicateRequestIdError(UsageError):
    """A request with this id is already in flight (a real engine would die on it)."""

    def __init__(self, request_id: str) -> None:
        super().__init__(f"request id {request_id!r} is already in flight")
        self.request_id = request_id


class ProtocolError(OperationalError):
    """A peer sent bytes that are not valid vLLM engine-core protocol.

    The message names the struct and field that was wrong.
    """


class SamplingMaskMismatchError(ProtocolError):
    """An output's sampling mask has a different number of rows than it has new tokens."""


class HandshakeError(OperationalError):
    """The start-up handshake with an engine failed (bad message, unexpected identity...)."""


class HandshakeTimeoutError(HandshakeError, TimeoutError):
    """The handshake did not complete in time. ``stage`` and ``missing`` say where it stuck."""

    def __init__(self, stage: str, missing: list[int], timeout: float) -> None:
        names = ", ".join(str(m) for m in missing) or "none"
        super().__init__(
            f"handshake timed out after {timeout:g} s waiting for {stage} "
            f"from engine(s) {names}"
        )
        self.stage = stage
        self.missing = missing
        self.timeout = timeout


class UnsupportedVersionError(HandshakeError):
    """The engine runs a vLLM version whose wire layout this client does not speak."""

    def __init__(self, engine_version: str, supported: str) -> None:
        super().__init__(
            f"engine runs vLLM {engine_version}, but this client speaks the wire layout of "
            f"vLLM {supported}"
        )
        self.engine_version = engine_version
        self.supported = supported


class TransportError(OperationalError):
    """A ZeroMQ socket failed (bind, connect, send or receive)."""


class EngineDeadError(OperationalError):
    """An engine died or became unreachable; the client is unhealthy from now on."""


class ClientClosedError(OperationalError):
    """The client was closed while this operation was pending, or before it started."""


class RequestStreamClosed(OperationalError):
    """The engine ended a request without a terminal output (e.g. listed in finished_requests)."""

    def __init__(self, request_id: str, reason: str = "closed by the engine") -> None:
        super().__init__(f"request {request_id!r}: stream {reason} without a final output")
        self.request_id = request_id


class IncompleteStreamError(OperationalError):
    """A stream of generate outputs ended before its terminal output."""


class UtilityCallError(OperationalError):
    """An engine answered a utility call with a failure message."""

    def __init__(self, method: str, message: str) -> None:
        super().__init__(f"utility call {method!r} failed: {message}")
        self.method = method
        self.message = message


class InconsistentUtilityResultsError(OperationalError):
    """Engines that must agree on a utility result (e.g. ``is_sleeping``) did not."""

    def __init__(self, method: str, results: list[object]) -> None:
        super().__init__(f"engines disagree on {method!r}: {results!r}")
        self.method = method
        self.results = results
