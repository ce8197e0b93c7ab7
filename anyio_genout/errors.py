"""The exceptions anyio-genout raises: one tree under :class:`GenoutError`.

What a caller can rely on is the class, never where the error came from:

* :class:`UsageError`: the caller asked for something invalid (a bad request, a duplicate
  id). Raised before anything is sent; the client is unaffected. Fix the call.
* :class:`OperationalError`: something outside the caller went wrong. Exactly one of:

  * :class:`ClientUnhealthyError` (*sticky*): the client is unhealthy for good. Every open
    stream and waiting utility call raises it once, every later call raises it at once;
    reconnect. (Raised by ``Client.connect``, no client was created.)
  * :class:`RequestFailedError`: one request failed; the client stays healthy and every
    other request runs on.
  * :class:`UtilityCallError`, :class:`InconsistentUtilityResultsError`: one utility call
    failed; the client stays healthy.
  * :class:`HandshakeError`: the start-up exchange failed; raised by ``Client.connect``
    only, no client was created.

No ``zmq.ZMQError``, msgpack exception or ``ExceptionGroup`` escapes the public API: each is
translated into one of these.

This module imports nothing but the standard library, so the sans-IO protocol core can use it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

__all__ = [
    "ChatTemplateError",
    "ModelFolderError",
    "ClientClosedError",
    "ClientUnhealthyError",
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
    "RequestFailedError",
    "RequestStreamClosedError",
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
    """Something outside the caller failed: an engine, the network, a peer.

    Every one is also exactly one of :class:`ClientUnhealthyError` (sticky),
    :class:`RequestFailedError` (one request), a utility-call error (one call) or a
    :class:`HandshakeError` (``Client.connect`` only).
    """


class ClientUnhealthyError(OperationalError):
    """Sticky: the client that raised it is unhealthy from now on, whatever the cause.

    It is the client's ``health_error``; every open stream and waiting utility call raises
    it once, every later call raises a fresh copy at once. Leave ``Client.connect`` and
    connect again. Raised by ``Client.connect``, no client was created.
    """


class RequestFailedError(OperationalError):
    """One request failed; the client stays healthy and every other request runs on."""


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


class ModelFolderError(UsageError):
    """A model folder cannot be used for text: a file is missing or malformed.

    The message names the folder and the file (and, for a malformed file, what is wrong).
    """


class ChatTemplateError(UsageError):
    """A chat template failed to parse or raised while rendering the messages.

    The message names the template line where it failed (``line`` is that number, or None
    if the template engine did not say), and the template's own message if it raised one.
    """

    def __init__(self, message: str, *, line: int | None = None) -> None:
        super().__init__(message)
        self.line = line


class ProtocolError(ClientUnhealthyError):
    """Sticky: a peer sent bytes that are not valid vLLM engine-core protocol, or an engine's
    connection came back while outputs were in flight (they may be lost).

    The message names the struct and field that was wrong. The client cannot know which
    request garbled bytes belonged to, so it fails them all.
    """


class SamplingMaskMismatchError(RequestFailedError):
    """One output's sampling mask has a different number of rows than it has new tokens.

    The message decoded fine; only this request's data is inconsistent, so only its stream
    fails (leaving the scope aborts it if it still runs).
    """


class HandshakeError(OperationalError):
    """The start-up handshake with an engine failed (bad message, unexpected identity...).

    Raised only while connecting (``Client.connect``; the mock engine's ``serve``): no client
    was created, nothing stays open."""


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


class TransportError(ClientUnhealthyError):
    """Sticky: a ZeroMQ socket failed (bind, connect, send or receive)."""


class EngineDeadError(ClientUnhealthyError):
    """Sticky: an engine died or became unreachable.

    ``ranks``: the data-parallel ranks of the engines that died, when known (else None).
    With ``HealthConfig(engine_failure="engine")`` (the default) it fails only the
    requests and calls of those engines while another engine lives; it makes the client
    unhealthy when the last engine dies (see docs/reliability.md).
    """

    def __init__(self, *args: object, ranks: Iterable[int] | None = None) -> None:
        super().__init__(*args)
        self.ranks: tuple[int, ...] | None = None if ranks is None else tuple(ranks)


class ClientClosedError(ClientUnhealthyError):
    """Sticky: the client was closed while this operation was pending, or before it started."""


class IncompleteStreamError(RequestFailedError):
    """A request's outputs ended before its terminal output (``collect_output`` saw them end:
    a stream consumed twice, closed from another task, an iterable that stops early)."""


class RequestStreamClosedError(IncompleteStreamError):
    """The engine ended a request without a terminal output (it listed the id in
    ``finished_requests``). The request is over in the engine; nothing is aborted."""

    def __init__(self, request_id: str, reason: str = "closed by the engine") -> None:
        super().__init__(f"request {request_id!r}: stream {reason} without a final output")
        self.request_id = request_id


class UtilityCallError(OperationalError):
    """An engine answered a utility call with a failure message, or (with several engines)
    an engine died while the call waited for it; the client stays healthy.

    ``failures`` maps the rank of each engine that failed to why (its failure message, or
    its death); ``results`` maps the rank of each engine that answered to its result. Both
    are empty when the error was not made by a call to several engines.
    """

    def __init__(self, method: str, message: str, *,
                 failures: Mapping[int, str] | None = None,
                 results: Mapping[int, object] | None = None) -> None:
        super().__init__(f"utility call {method!r} failed: {message}")
        self.method = method
        self.message = message
        self.failures: dict[int, str] = dict(failures or {})
        self.results: dict[int, object] = dict(results or {})


class InconsistentUtilityResultsError(OperationalError):
    """Engines that must agree on a utility result (e.g. ``is_sleeping``) did not; the client
    stays healthy."""

    def __init__(self, method: str, results: list[object]) -> None:
        super().__init__(f"engines disagree on {method!r}: {results!r}")
        self.method = method
        self.results = results


def keyboard_interrupt_in(group: BaseExceptionGroup[BaseException]
                          ) -> KeyboardInterrupt | None:
    """The first :class:`KeyboardInterrupt` in ``group`` (nested groups too), or None.

    On trio a Ctrl-C is raised in whichever task is running, so a background task of ours
    can end with it and its task group then raises it in a group: re-raise this one instead
    (``raise interrupt from None``), as a plain Ctrl-C should be.
    """
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            found = keyboard_interrupt_in(exc)
            if found is not None:
                return found
        elif isinstance(exc, KeyboardInterrupt):
            return exc
    return None
