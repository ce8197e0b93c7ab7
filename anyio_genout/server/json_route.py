"""``JsonRoute``: a POST route that reads and validates its JSON body itself, for the two
routes every generation takes (``/v1/completions``, ``/v1/chat/completions``).

FastAPI's handling around an endpoint (a ``Request``, two ``AsyncExitStack``\\ s, its
dependency solver, its content-type parsing, its exception wrapper) was 19.6 % of the
server's CPU on a one-token completion (py-spy, 64 streams, uvicorn); this route reads the
body, ``json.loads`` it and ``model_validate``\\ s it, which is what FastAPI does with it
too, and calls the endpoint. Only a body FastAPI would have turned into the same model
takes that path. Anything else (no ``application/json`` content type, a body that is not
JSON, or not the model, a client gone in the middle of its body) goes to the router again,
the messages already read replayed, and this route does not match it there: FastAPI's
route of the same path answers it, so every refusal, to the byte, is still FastAPI's and
the app's handlers', decided in one place. Methods other than POST never match here.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Final

from pydantic import BaseModel
from starlette.responses import Response
from starlette.routing import Match, Route
from starlette.types import Message, Receive, Scope, Send

from .headers import first_header

__all__ = ["JsonRoute"]

#: Set in the scope of a request handed back to the router: this route does not match it.
_REROUTED: Final = "anyio_genout.rerouted"


def _is_json(scope: Scope) -> bool:
    """Whether the first ``content-type`` header is ``application/json`` (any case, any
    parameters), which every FastAPI version reads as JSON; other types, ``+json`` ones
    and none at all go to FastAPI, whose rules for them differ between its versions."""
    value = first_header(scope, b"content-type")
    return value is not None and value.partition(b";")[0].strip().lower() == b"application/json"


class _Endpoint:
    """The ASGI app of a :class:`JsonRoute`."""

    __slots__ = ("_model", "_respond")

    def __init__(self, model: type[BaseModel], respond: Callable[[Any, Scope], Response]
                 ) -> None:
        self._model = model
        self._respond = respond

    def _parse(self, scope: Scope, body: bytes) -> BaseModel | None:
        """The body as the model, or None if FastAPI is to answer it."""
        if not body or not _is_json(scope):
            return None
        try:
            return self._model.model_validate(json.loads(body))
        except Exception:  # FastAPI meets the same and answers it (400, 422 or 500)
            return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        messages: list[Message] = []
        chunks: list[bytes] = []
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":  # the client left mid-body
                break
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                body = self._parse(scope, b"".join(chunks))
                if body is not None:
                    await self._respond(body, scope)(scope, receive, send)
                    return
                break
        await _reroute(scope, messages, receive, send)


async def _reroute(scope: Scope, messages: list[Message], receive: Receive, send: Send
                   ) -> None:
    """Hand the request to the router again, with ``messages`` read first."""
    replay = iter(messages)

    async def replayed() -> Message:
        for message in replay:
            return message
        return await receive()

    scope[_REROUTED] = True
    await scope["router"](scope, replayed, send)


class JsonRoute(Route):
    """POST ``path``: the body, JSON validated as ``model``, goes to ``respond(body,
    scope)``, whose response is sent; anything else, to the router's other routes (see
    the module docstring). Put it before FastAPI's route of the same path and endpoint.
    Raises what ``respond`` and the response raise."""

    def __init__(self, path: str, model: type[BaseModel],
                 respond: Callable[[Any, Scope], Response]) -> None:
        super().__init__(path, _Endpoint(model, respond), methods=["POST"],
                         include_in_schema=False)

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        if scope["type"] != "http" or scope["method"] != "POST" or _REROUTED in scope:
            return Match.NONE, {}
        match, child_scope = super().matches(scope)
        if match is Match.FULL:
            child_scope["route"] = self  # as FastAPI's routes do: HttpMetrics reads it
        return match, child_scope
