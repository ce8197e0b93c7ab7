"""``Authentication``: the ASGI middleware that checks the API key before anything of a
request's body is read (401 in OpenAI's error shape), on the routes of its scope."""

from __future__ import annotations

import hashlib
import hmac
from typing import Final, Literal

import anyio
import attrs
from starlette.types import ASGIApp, Receive, Scope, Send

from .errors import error_response
from .headers import first_header
from .limits import draining_send, tolerant_send

__all__ = ["OPEN_PATHS", "V1_PREFIXES", "ApiKeyScope", "Authentication", "check_api_key"]

#: What the key guards: ``"v1"`` the paths vLLM 0.32's ``AuthenticationMiddleware`` guards
#: (those starting with one of :data:`V1_PREFIXES`), ``"all"`` every path but
#: :data:`OPEN_PATHS`.
ApiKeyScope = Literal["v1", "all"]

#: vLLM 0.32's ``GUARDED_PREFIX`` (a plain ``str.startswith``, so ``/v1x`` counts too).
V1_PREFIXES: Final = ("/v1", "/v2", "/inference", "/cohere")

#: The liveness routes a load balancer or orchestrator probes without a key, in either scope.
OPEN_PATHS: Final = frozenset({"/health", "/ping", "/version"})


def check_api_key(api_key: str | None, api_key_scope: str) -> None:
    """Raises :class:`ValueError` for an empty key or a scope other than ``"v1"`` and
    ``"all"`` (the key is not quoted)."""
    if api_key == "":
        raise ValueError("api_key must not be empty (give None for no key)")
    if api_key_scope not in ("v1", "all"):
        raise ValueError(f"api_key_scope must be 'v1' or 'all', got {api_key_scope!r}")


def _digest(token: bytes) -> bytes:
    return hashlib.sha256(token).digest()


@attrs.frozen
class Authentication:
    """Answer 401 to a request on a guarded path without ``Authorization: Bearer
    <api_key>``, from its headers alone: nothing of its body is read (an invalid JSON body,
    a ``content-length`` beyond the body limit, a chunked one: 401, never 400 or 413).

    As vLLM does it: the scheme is case-insensitive, the key is compared in constant time
    (SHA-256 digests, :func:`hmac.compare_digest`), the ``root_path`` is taken off the path
    before the scope is checked, ``OPTIONS`` requests (CORS preflights, which carry no
    credentials) and lifespan events pass, WebSocket handshakes are guarded like HTTP.
    The key is never logged nor quoted in an answer. Raises :class:`ValueError` for an
    empty key or an ``api_key_scope`` other than ``"v1"`` and ``"all"``; nothing while
    serving.
    """

    app: ASGIApp
    api_key: str = attrs.field(repr=False)
    api_key_scope: ApiKeyScope = "v1"
    #: How long the body a refused client sends on may be read and dropped at most (see
    #: :func:`~anyio_genout.server.limits.draining_send`).
    body_timeout: float | None = 30.0
    _expected: bytes = attrs.field(init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        check_api_key(self.api_key, self.api_key_scope)
        object.__setattr__(self, "_expected", _digest(self.api_key.encode()))

    def guards(self, path: str) -> bool:
        """Whether a request to ``path`` (the root path taken off) needs the key."""
        if self.api_key_scope == "v1":
            return path.startswith(V1_PREFIXES)
        return path not in OPEN_PATHS

    def _authorized(self, scope: Scope) -> bool:
        value = first_header(scope, b"authorization")
        if value is None:
            return False
        scheme, _, token = value.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(_digest(token),
                                                                   self._expected)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        root = scope.get("root_path", "")
        path: str = scope["path"]
        if self.guards(path.removeprefix(root) if root else path) and not self._authorized(
                scope):
            response = error_response(401, "invalid API key")
            response.headers["www-authenticate"] = "Bearer"
            deadline = (None if self.body_timeout is None
                        else anyio.current_time() + self.body_timeout)
            await response(scope, receive, draining_send(tolerant_send(send), receive,
                                                         deadline, lambda: False))
            return
        await self.app(scope, receive, send)
