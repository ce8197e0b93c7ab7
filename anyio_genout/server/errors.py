"""OpenAI's error body, ``{"error": {"message", "type", "param", "code"}}``, with vLLM's
status codes, and the exception handlers that give every failure that shape."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from http import HTTPStatus
from typing import Any, Final

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import Response

from ..errors import ClientUnhealthyError, GenoutError, InvalidRequestError, UsageError

__all__ = ["ApiError", "error_body", "error_for", "error_response", "install_handlers",
           "validation_error"]

_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
          405: "MethodNotAllowed", 422: "BadRequestError", 500: "InternalServerError",
          503: "ServiceUnavailableError"}


class ApiError(Exception):
    """Raised by a route to answer ``status`` with OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _TYPES.get(status, HTTPStatus(status).phrase),
                      "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None) -> Response:
    return Response(json.dumps(error_body(status, message, param)), status_code=status,
                    media_type="application/json")


def error_for(exc: GenoutError) -> ApiError:
    """The HTTP answer to an error of the library: 400 for the caller's mistakes (naming
    the field), 503 while the client is unhealthy, 500 for a failed request."""
    if isinstance(exc, InvalidRequestError):
        return ApiError(400, str(exc), exc.field)
    if isinstance(exc, UsageError):
        return ApiError(400, str(exc))
    if isinstance(exc, ClientUnhealthyError):
        return ApiError(503, f"the engines are unavailable: {exc}")
    return ApiError(500, f"the request failed: {exc}")


def _loc(loc: tuple[int | str, ...], body: Any) -> str:
    # pydantic puts a union member's tag in loc ("stop", "str"; "prompt", "list[int]", 0):
    # keep only the parts that are keys or indexes of the body sent.
    parts: list[str] = []
    node = body
    path = loc[1:] if loc[:1] == ("body",) else loc
    for i, p in enumerate(path):
        if isinstance(node, dict) and p in node:  # noqa: SIM114 - mypy narrows p per branch
            node = node[p]
        elif isinstance(node, list) and isinstance(p, int) and 0 <= p < len(node):
            node = node[p]
        elif isinstance(node, dict) and i == len(path) - 1 and "[" not in str(p):
            node = None  # a missing field
        else:
            continue  # a union member's tag
        parts.append(str(p))
    text = ""
    for part in parts:
        text += f"[{part}]" if part.isdigit() else (f".{part}" if text else part)
    return text or "body"


async def _on_api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return error_response(exc.status, exc.message, exc.param)


def validation_error(errors: Sequence[Mapping[str, Any]], body: Any) -> ApiError:
    """The 400 of a body that failed its pydantic model (``errors``, pydantic's
    ``ValidationError.errors()``, locations with or without FastAPI's leading ``"body"``):
    the first error, ``param`` its location in ``body`` with the union tags stripped
    (``prompt``, ``stop[0]``). The server's handler and ``run``'s batch lines both answer
    with it, so the two name a field alike."""
    first = _telling(errors) if errors else {"loc": (), "msg": "invalid body"}
    if first.get("type") == "json_invalid":
        # loc is ("body", <character offset>): not a field, so no param.
        ctx = first.get("ctx")
        detail = str(ctx.get("error", "")) if isinstance(ctx, dict) else ""
        return ApiError(400, f"invalid request: the body is not valid JSON ({detail})"
                        if detail else "invalid request: the body is not valid JSON")
    param = _loc(tuple(first.get("loc", ())), body)
    return ApiError(400, f"invalid request: {param}: {first.get('msg', 'invalid')}", param)


#: Errors that say what is wrong with a union field's value as the type it is.
_LENGTH_ERRORS: Final = frozenset({"too_long", "too_short"})


def _telling(errors: Sequence[Mapping[str, Any]]) -> Mapping[str, Any]:
    """The error to show: the first, unless it says a union field's value is not of one of
    its types (``string_type`` for ``stop: ["a", ...]``) and another error on the same
    field says the value has too many or too few items (``too_long``: at most 4 items)."""
    first = errors[0]

    def field(error: Mapping[str, Any]) -> Any:
        loc = tuple(error.get("loc", ()))
        return loc[1:2] if loc[:1] == ("body",) else loc[:1]

    if str(first.get("type", "")).endswith("_type"):
        for error in errors[1:]:
            if error.get("type") in _LENGTH_ERRORS and field(error) == field(first):
                return error
    return first


async def _on_validation(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    error = validation_error(exc.errors(), exc.body)
    return error_response(error.status, error.message, error.param)


async def _on_http(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    return error_response(exc.status_code, str(exc.detail))


async def _on_unexpected(request: Request, exc: Exception) -> Response:
    # Starlette's ServerErrorMiddleware calls this (and still re-raises, so the traceback
    # is logged) when a route fails before its response started: the client gets OpenAI's
    # body, not a text/plain "Internal Server Error". Nothing of the exception is shown.
    return error_response(500, "internal server error")


def install_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, _on_api_error)
    app.add_exception_handler(RequestValidationError, _on_validation)
    app.add_exception_handler(HTTPException, _on_http)
    app.add_exception_handler(Exception, _on_unexpected)
