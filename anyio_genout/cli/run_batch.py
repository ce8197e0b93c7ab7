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
from collections.abc import Mapping
from typing import Any, BinaryIO, Final, cast

import attrs

from ..errors import InvalidRequestError, UsageError
from ..text.client import TextClient
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
    """The server's ``app`` and ``serving`` modules (the server extra is optional)."""
    try:
        from ..server import app, serving
    except ImportError as exc:
        raise UsageError("OpenAI batch lines need the server extra (pip install "
                         f"'anyio-genout[server]'): {exc}") from None
    return app, serving


def _tool_serving(tool_flags: Mapping[str, Any] | None) -> Any:
    """The server's ``ToolServing`` of ``run``'s tool flags (``enable_auto_tool_choice``,
    ``tool_call_parser``, ``reasoning_parser``; checked by ``check_tool_args``)."""
    from ..server.tools import ToolServing

    return ToolServing.from_names(**(tool_flags or {}))


def _error_line(custom_id: str, exc: Any) -> dict[str, Any]:
    """The output line of the server's ``ApiError`` ``exc``: its status, OpenAI's body."""
    from ..server.errors import error_body

    return output_line(custom_id, exc.status, None, error_body(exc.status, exc.message,
                                                               exc.param))


class BatchParser:
    """Turns batch lines into :class:`BatchItem`; ``model`` names the model in responses.

    A line that is not a JSON object with a string ``custom_id`` and the other keys is a
    :class:`BadLine` (it cannot have an output line); an unsupported ``url`` or ``method``
    and an invalid ``body`` give the item its error line instead.
    """

    def __init__(self, model: str, tool_flags: Mapping[str, Any] | None = None) -> None:
        app, self._serving = _server()
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
        from ..server.errors import ApiError

        try:
            body = self._body(url, value["body"])
        except ApiError as exc:
            return BatchItem(custom_id, error_line=_error_line(custom_id, exc))
        return BatchItem(custom_id, url, body)

    def _body(self, url: str, body: Any) -> Any:
        """``body`` validated with the server's request model, its requests made and checked
        as the server makes them (what needs the engines, the vocabulary and
        ``max_model_len``, is checked again when it runs).

        Raises the server's ``ApiError`` (400 naming the field as the server names it) for
        an invalid body.
        """
        from ..server.errors import ApiError

        serving = self._serving
        parsed = serving.parse_body(url, body)
        if parsed.stream:
            raise ApiError(400, "invalid request: stream: Request must not be sent "
                           "in stream mode", "stream")
        if parsed.model is None:
            parsed = parsed.model_copy(update={"model": self._model})
        serving.check_choices(serving.choices(parsed, max_n=self._max_n, max_model_len=None,
                                              tool_serving=self._tools))
        return parsed


class BatchRunner:
    """Runs :class:`BatchItem` on ``text_client`` and makes their output lines: each body
    is served by the server's serving functions (:mod:`anyio_genout.server.serving`), so
    the response bodies and the errors are the server's, their ``system_fingerprint``
    too (``fingerprint_mode`` and ``fingerprint_value`` as ``serve``'s flags, ``model`` the
    served name it hashes).

    Raises the server's ``InvalidRequestError`` for a bad fingerprint mode or value.
    """

    def __init__(self, text_client: TextClient,
                 tool_flags: Mapping[str, Any] | None = None, *, model: str = "anyio-genout",
                 fingerprint_mode: str = "full", fingerprint_value: str | None = None) -> None:
        self._text = text_client
        app, self._serving = _server()
        from ..server.fingerprint import FingerprintMode, system_fingerprint

        fingerprint = system_fingerprint(text_client, model_name=model,  # mode checked there
                                         mode=cast("FingerprintMode", fingerprint_mode),
                                         value=fingerprint_value)
        # The model is each body's (given, or run's --model): batch lines do not check it.
        from ..server.generation_defaults import generation_defaults

        # The model folder's sampling defaults, as vllm run-batch applies them.
        defaults = generation_defaults("auto", text_client.tokenizer.model_dir)
        self._server = self._serving.Serving(text_client=text_client, model_name="",
                                             max_n=app.MAX_N,
                                             tool_serving=_tool_serving(tool_flags),
                                             fingerprint=lambda: fingerprint,
                                             sampling_defaults=defaults)

    async def run(self, item: BatchItem) -> tuple[dict[str, Any], str | None, int]:
        """The output line, the failure (None if it succeeded) and the tokens generated."""
        if item.error_line is not None:
            return item.error_line, _failure(item.error_line), 0
        from ..server.errors import ApiError

        serving = self._serving
        try:
            plan = self._server.plan(item.body, model=item.body.model)
            body = await serving.serve_whole(serving.Generation(self._text, plan))
        except ApiError as exc:
            line = _error_line(item.custom_id, exc)
            return line, _failure(line), 0
        return (output_line(item.custom_id, 200, body, None), None,
                int(body["usage"]["completion_tokens"]))


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
