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
import time
from typing import TYPE_CHECKING, Any, BinaryIO, Final

import attrs

from ..errors import GenoutError, InvalidRequestError, UsageError
from ..text.client import TextClient
from ..text.output import collect_text
from ..text.request import TextRequest, check_text_request
from ..text.stream import encode_prompt
from .options import check_max_tokens
from .run_input import BadLine

if TYPE_CHECKING:
    from ..server.formats import Format

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
    """One parsed batch line: a request to run with its response format, or its error line."""

    custom_id: str
    request: TextRequest | None = None
    fmt: Format | None = None
    error_line: dict[str, Any] | None = None

    @property
    def request_id(self) -> str:
        return self.custom_id


def _server() -> Any:
    try:
        from ..server import errors, formats, models, requests
    except ImportError as exc:
        raise UsageError("OpenAI batch lines need the server extra (pip install "
                         f"'anyio-genout[server]'): {exc}") from None
    return errors, formats, models, requests


class BatchParser:
    """Turns batch lines into :class:`BatchItem`; ``model`` names the model in responses.

    A line that is not a JSON object with a string ``custom_id`` and the other keys is a
    :class:`BadLine` (it cannot have an output line); an unsupported ``url`` or ``method``
    and an invalid ``body`` give the item its error line instead.
    """

    def __init__(self, model: str) -> None:
        self._errors, self._formats, self._models, self._requests = _server()
        self._model = model

    def parse(self, number: int, line: bytes) -> BatchItem:
        try:
            value = json.loads(line)
        except UnicodeDecodeError:
            raise BadLine(f"line {number}: not valid UTF-8") from None
        except json.JSONDecodeError as exc:
            raise BadLine(f"line {number}: not valid JSON ({exc.msg})") from None
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
            request, fmt = self._request(url, value["body"])
        except self._errors.ApiError as exc:
            return BatchItem(custom_id, error_line=output_line(
                custom_id, exc.status, None,
                self._errors.error_body(exc.status, exc.message, exc.param)))
        return BatchItem(custom_id, request=request, fmt=fmt)

    def _request(self, url: str, body: Any) -> tuple[TextRequest, Format]:
        """The request and response format of ``body``, as the server makes them.

        Raises the server's ``ApiError`` (400 naming the field) for an invalid body.
        """
        import pydantic

        errors = self._errors
        model = (self._models.CompletionRequest if url == COMPLETIONS_URL
                 else self._models.ChatCompletionRequest)
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
        if parsed.n != 1:
            raise errors.ApiError(400, "invalid request: n: only n=1 is supported in batch "
                                  "files yet", "n")
        name = parsed.model or self._model
        fmt: Format
        if url == COMPLETIONS_URL:
            request, echo = self._requests.completion_request(parsed, decode=None)
            fmt = self._formats.CompletionFormat(request.request_id, name, parsed.logprobs,
                                                 echo)
        else:
            request = self._requests.chat_request(parsed)
            fmt = self._formats.ChatFormat(request.request_id, name,
                                           request.sampling_params.logprobs)
        try:
            check_text_request(request)
        except InvalidRequestError as exc:
            raise errors.error_for(exc) from None
        return request, fmt


class BatchRunner:
    """Runs :class:`BatchItem` on ``text_client`` and makes their output lines."""

    def __init__(self, text_client: TextClient) -> None:
        self._text = text_client
        self._errors = _server()[0]

    async def run(self, item: BatchItem) -> tuple[dict[str, Any], str | None, int]:
        """The output line, the failure (None if it succeeded) and the tokens generated."""
        if item.error_line is not None:
            return item.error_line, _failure(item.error_line), 0
        request, fmt = item.request, item.fmt
        assert request is not None and fmt is not None
        client = self._text.client
        try:
            _, ids = encode_prompt(self._text.tokenizer, request)
            check_max_tokens(len(ids), request.sampling_params.max_tokens,
                             client.engine.max_model_len)
            async with self._text.generate(request) as stream:
                whole = await collect_text(stream)
        except GenoutError as exc:
            error = self._errors.error_for(exc)
            line = output_line(item.custom_id, error.status, None,
                               self._errors.error_body(error.status, error.message,
                                                       error.param))
            return line, _failure(line), 0
        # One choice (n=1); whole() takes a list of them once the server does n > 1.
        whole_of: Any = fmt.whole
        body = whole_of([whole] if hasattr(fmt, "whole_choice") else whole)
        body["created"] = int(time.time())
        return output_line(item.custom_id, 200, body, None), None, len(whole.token_ids)


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
