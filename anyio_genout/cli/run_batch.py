"""``anyio-genout run`` on the OpenAI batch file format, as ``vllm run-batch`` reads and writes it.

An input line is ``{"custom_id": ..., "method": "POST", "url": ..., "body": {...}}``; the
whole file is in that format when its first line is (:func:`is_batch_line`). ``url`` is
``/v1/completions`` or ``/v1/chat/completions``, and ``body`` is validated and means what it
means to ``anyio-genout serve`` (the server's request models and translation). Each output
line is vLLM's ``BatchRequestOutput``: ``{"id": "vllm-<hex>", "custom_id": ...,
"response": {"status_code": 200, "request_id": "vllm-batch-<hex>", "body": <the response
body>}, "error": null}``; a failed request has ``"body": null``, its status code, and
``"error"``: OpenAI's error body, or a message string for an unsupported ``url`` or
``method``, as vLLM writes them. Needs the ``server`` extra and a tokenizer.
"""

from __future__ import annotations

import json
import os
import re
import threading
from collections.abc import Mapping, Sequence
from typing import Any, BinaryIO, Final

import anyio
import attrs

from ..errors import InvalidRequestError, UsageError
from ..text.client import TextClient
from ..text.request import check_text_request
from .run_input import BadLine, decode_line

__all__ = ["BATCH_KEYS", "CHAT_URL", "COMPLETIONS_URL", "BatchItem", "BatchParser",
           "BatchRunner", "batch_line_id", "first_line", "is_batch_line", "output_line"]

#: The keys that make a line an OpenAI batch line.
BATCH_KEYS: Final = ("custom_id", "method", "url", "body")
COMPLETIONS_URL: Final = "/v1/completions"
CHAT_URL: Final = "/v1/chat/completions"

#: A top-level ``"custom_id": "..."`` without escapes (see ``run_input.ID_KEY``).
_CUSTOM_ID: Final = re.compile(rb'"custom_id"\s*:\s*"([^"\\]*)"')


def is_batch_line(line: bytes) -> bool:
    """True if ``line`` is a JSON object with every key of :data:`BATCH_KEYS`."""
    try:
        value = json.loads(line)
    except ValueError:
        return False
    return isinstance(value, dict) and all(key in value for key in BATCH_KEYS)


def batch_line_id(line: bytes, number: int) -> str | None:
    """The ``custom_id`` of a batch input line (None: it has none, or not a string)."""
    found = _CUSTOM_ID.findall(line)
    if len(found) == 1:
        try:
            return str(found[0].decode())
        except UnicodeDecodeError:
            return None
    try:
        value = json.loads(line)
    except ValueError:
        return None
    custom_id = value.get("custom_id") if isinstance(value, dict) else None
    return custom_id if isinstance(custom_id, str) else None


def _hex() -> str:
    return os.urandom(8).hex()  # 16 hex digits, as vllm.utils.random_uuid


def output_line(custom_id: str, status: int, body: dict[str, Any] | None,
                error: Any) -> dict[str, Any]:
    """vLLM's ``BatchRequestOutput`` as it writes it (``model_dump_json``)."""
    return {"id": f"vllm-{_hex()}", "custom_id": custom_id,
            "response": {"status_code": status, "request_id": f"vllm-batch-{_hex()}",
                         "body": body}, "error": error}


@attrs.frozen
class BatchItem:
    """One parsed batch line: a body to run (its ``url`` and validated ``body``), or its
    error line."""

    custom_id: str
    url: str = COMPLETIONS_URL
    body: Any = None
    error_line: dict[str, Any] | None = None

    @property
    def request_id(self) -> str:
        return self.custom_id


def _server() -> Any:
    try:
        from ..server import app, errors, requests, response
    except ImportError as exc:
        raise UsageError("OpenAI batch lines need the server extra (pip install "
                         f"'anyio-genout[server]'): {exc}") from None
    return app, errors, requests, response


def _tool_serving(tool_flags: Mapping[str, Any] | None) -> Any:
    """The server's ``ToolServing`` of ``run``'s tool flags (``enable_auto_tool_choice``,
    ``tool_call_parser``, ``reasoning_parser``; checked by ``check_tool_args``)."""
    from ..server.tools import ToolServing

    return ToolServing.from_names(**(tool_flags or {}))


def _choices(requests: Any, max_n: int, url: str, body: Any, max_model_len: int | None,
             vocab_size: int | None, tools: Any = None) -> Any:
    """The server's choices of ``body`` (its ``requests.Choices``), as the server makes
    them with its default ``max_n`` and ``tools`` (a ``ToolServing``). Raises the
    server's ``ApiError`` (400 naming the field)."""
    if url == COMPLETIONS_URL:
        return requests.completion_choices(body, max_n=max_n, max_model_len=max_model_len,
                                           vocab_size=vocab_size)
    return requests.chat_choices(body, max_n=max_n, max_model_len=max_model_len,
                                 tool_serving=tools)


class BatchParser:
    """Turns batch lines into :class:`BatchItem`; ``model`` names the model in responses.

    A line that is not a JSON object with a string ``custom_id`` and the other keys is a
    :class:`BadLine` (it cannot have an output line); an unsupported ``url`` or ``method``
    and an invalid ``body`` give the item its error line instead.
    """

    def __init__(self, model: str, tool_flags: Mapping[str, Any] | None = None) -> None:
        app, self._errors, self._requests, _ = _server()
        self._max_n: int = app.MAX_N
        self._model = model
        self._tools = _tool_serving(tool_flags)

    def parse(self, number: int, line: bytes) -> BatchItem:
        value = decode_line(number, line)
        if not isinstance(value, dict):
            raise BadLine(f"line {number}: {InvalidRequestError('line', 'must be a JSON object')}")
        missing = [key for key in BATCH_KEYS if key not in value]
        if missing:
            raise BadLine(f"line {number}: "
                          f"{InvalidRequestError(missing[0], 'missing (an OpenAI batch line)')}")
        custom_id = value["custom_id"]
        if not isinstance(custom_id, str):
            raise BadLine(f"line {number}: "
                          f"{InvalidRequestError('custom_id', 'must be a string')}")
        url, method = value["url"], value["method"]
        if url not in (COMPLETIONS_URL, CHAT_URL):
            return BatchItem(custom_id, error_line=output_line(
                custom_id, 400, None, f"URL {url} was used. Supported endpoints: "
                f"{COMPLETIONS_URL}, {CHAT_URL}."))
        if method != "POST":
            return BatchItem(custom_id, error_line=output_line(
                custom_id, 400, None, f"Method {method} was used. Only POST is supported."))
        try:
            body = self._body(url, value["body"])
        except self._errors.ApiError as exc:
            return BatchItem(custom_id, error_line=output_line(
                custom_id, exc.status, None,
                self._errors.error_body(exc.status, exc.message, exc.param)))
        return BatchItem(custom_id, url, body)

    def _body(self, url: str, body: Any) -> Any:
        """``body`` validated with the server's request model, its requests made and checked
        as the server makes them (what needs the engines, the vocabulary and
        ``max_model_len``, is checked again when it runs).

        Raises the server's ``ApiError`` (400 naming the field) for an invalid body.
        """
        import pydantic

        from ..server import models

        errors = self._errors
        model = (models.CompletionRequest if url == COMPLETIONS_URL
                 else models.ChatCompletionRequest)
        try:
            parsed = model.model_validate(body)
        except pydantic.ValidationError as exc:
            first = exc.errors()[0]
            param = ".".join(str(p) for p in first["loc"]) or "body"
            raise errors.ApiError(400, f"invalid request: {param}: {first['msg']}",
                                  param) from None
        if parsed.stream:
            raise errors.ApiError(400, "invalid request: stream: Request must not be sent "
                                  "in stream mode", "stream")
        if parsed.model is None:
            parsed = parsed.model_copy(update={"model": self._model})
        for request in _choices(self._requests, self._max_n, url, parsed, None,
                                None, self._tools).requests:
            try:
                check_text_request(request)
            except InvalidRequestError as exc:
                raise errors.error_for(exc) from None
        return parsed


class BatchRunner:
    """Runs :class:`BatchItem` on ``text_client`` and makes their output lines: each body
    runs as the server runs it (its choices, its ``TextResponse``), so the response bodies
    are the server's."""

    def __init__(self, text_client: TextClient,
                 tool_flags: Mapping[str, Any] | None = None) -> None:
        self._text = text_client
        app, self._errors, self._requests, self._response = _server()
        self._max_n: int = app.MAX_N
        self._tools = _tool_serving(tool_flags)

    async def run(self, item: BatchItem) -> tuple[dict[str, Any], str | None, int]:
        """The output line, the failure (None if it succeeded) and the tokens generated."""
        if item.error_line is not None:
            return item.error_line, _failure(item.error_line), 0
        tokenizer = self._text.tokenizer
        try:
            plan = _choices(self._requests, self._max_n, item.url, item.body,
                            self._text.client.engine.max_model_len, tokenizer.vocab_size,
                            self._tools)
        except self._errors.ApiError as exc:
            line = output_line(item.custom_id, exc.status, None,
                               self._errors.error_body(exc.status, exc.message, exc.param))
            return line, _failure(line), 0

        def decode(ids: Sequence[int]) -> str:
            return tokenizer.decode(list(ids), skip_special_tokens=False)

        status, body = await _respond(self._response.TextResponse(
            self._text, plan.requests, plan.format(item.body.model, decode), stream=False,
            include_usage=False))
        if status != 200:
            line = output_line(item.custom_id, status, None, body)
            return line, _failure(line), 0
        return (output_line(item.custom_id, 200, body, None), None,
                int(body["usage"]["completion_tokens"]))


async def _respond(response: Any) -> tuple[int, dict[str, Any]]:
    """The status and JSON body of the server's whole (not streamed) ``response``, run as
    the ASGI server would run it, with a client that never leaves."""
    messages: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        messages.append(message)

    await response({"type": "http"}, receive, send)
    status = int(messages[0]["status"])
    body = json.loads(b"".join(m.get("body", b"") for m in messages[1:]))
    return status, body


def _failure(line: dict[str, Any]) -> str:
    error = line["error"]
    if isinstance(error, dict):
        return str(error["error"]["message"])
    return str(error)


def first_line(source: BinaryIO, stop: threading.Event) -> bytes | None:
    """The first non-blank line of a seekable ``source`` (None if none); rewinds it."""
    try:
        for number, line in enumerate(source, 1):
            if not number & 0xFFF and stop.is_set():
                return None
            if line.strip():
                return line
        return None
    finally:
        source.seek(0)
