"""``anyio-genout run``'s input: JSONL request lines, read as they are needed.

:class:`LineReader` streams lines from a worker thread; :func:`scan` is the counting pass over
a seekable input (the total for progress, and the ids that may repeat, found with a
fixed-size Bloom filter, :class:`IdFilter`); :class:`LineParser` turns a line into a
:class:`~anyio_genout.GenerateRequest` (no tokenizer), a :class:`TextRequest` (with one) or a
:class:`BadLine`; :func:`check_all` is ``--strict``'s pass over every line first.

A line's prompt is one of ``prompt_token_ids``, ``prompt`` (text) and ``messages`` (chat);
``add_special_tokens``, ``add_generation_prompt`` and ``chat_template_kwargs`` sit beside
it, and the text options of vLLM's ``SamplingParams`` (``stop``,
``include_stop_str_in_output``, ``skip_special_tokens``, ``spaces_between_special_tokens``,
``detokenize``) in ``sampling_params`` with the token-level ones.
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
import threading
from typing import Any, BinaryIO, Final

import anyio

from ..errors import InvalidRequestError, UsageError
from ..generate import GenerateRequest
from ..text.request import TextRequest, check_text_request
from .options import sampling_from_mapping
from .text_model import NO_TOKENIZER

__all__ = ["CHUNK_SIZE", "ID_KEY", "BadLine", "IdFilter", "LineParser", "LineReader", "Scan",
           "check_all", "decode_line", "in_thread", "line_id", "open_input", "quick_id", "scan",
           "spool"]

#: Bytes read from the input at a time (one thread hop each).
CHUNK_SIZE: Final = 1 << 16


#: Keys of a line that only a text request has (beside ``prompt_token_ids``).
_TEXT_KEYS: Final = ("prompt", "messages", "add_special_tokens", "add_generation_prompt",
                     "chat_template_kwargs")
_KEYS: Final = frozenset({"request_id", "prompt_token_ids", "sampling_params", "priority",
                          "cache_salt", *_TEXT_KEYS})
#: vLLM's text options of ``SamplingParams``: in ``sampling_params``, for the text layer.
_TEXT_SAMPLING_KEYS: Final = ("stop", "include_stop_str_in_output", "skip_special_tokens",
                              "spaces_between_special_tokens", "detokenize")


class BadLine(Exception):
    """An input line that is not a valid request (the message names the problem)."""


class IdFilter:
    """A fixed-size Bloom filter over request ids: 8 MiB whatever the number of ids."""

    _BITS: Final = 1 << 26

    def __init__(self) -> None:
        self._bits = bytearray(self._BITS >> 3)

    def add(self, request_id: str) -> bool:
        """Add ``request_id``; True if it may have been added before."""
        h = hash(request_id)
        # Three probes from one 64-bit hash (double hashing), unrolled: this runs per line.
        a, b = h & 0x3FF_FFFF, ((h >> 32) & 0x3FF_FFFF) | 1
        c, d = (a + b) & 0x3FF_FFFF, (a + 2 * b) & 0x3FF_FFFF
        bits = self._bits
        seen = (bits[a >> 3] >> (a & 7)) & (bits[c >> 3] >> (c & 7)) & (bits[d >> 3] >> (d & 7)) & 1
        bits[a >> 3] |= 1 << (a & 7)
        bits[c >> 3] |= 1 << (c & 7)
        bits[d >> 3] |= 1 << (d & 7)
        return bool(seen)


#: A top-level ``"request_id": "..."`` without escapes. Inside a JSON string every quote is
#: escaped, so a match is a key: the request's own (or a nested one's, an invalid line).
ID_KEY: Final = re.compile(rb'"request_id"\s*:\s*"([^"\\]*)"')


def decode_line(number: int, line: bytes) -> Any:
    """Input line ``number`` parsed as JSON; raises :class:`BadLine` if it is not UTF-8 or
    not JSON."""
    try:
        return json.loads(line)
    except UnicodeDecodeError:
        raise BadLine(f"line {number}: not valid UTF-8") from None
    except json.JSONDecodeError as exc:
        raise BadLine(f"line {number}: not valid JSON ({exc.msg})") from None


def quick_id(line: bytes) -> tuple[bool, str | None]:
    """``(True, id)`` when :data:`ID_KEY` finds exactly one id in ``line`` (``id`` is None
    when it is not UTF-8), ``(False, None)`` when the line must be parsed in full."""
    found = ID_KEY.findall(line)
    if len(found) != 1:
        return False, None
    try:
        return True, found[0].decode()
    except UnicodeDecodeError:
        return True, None


def line_id(line: bytes, number: int) -> str | None:
    """The request id of ``line`` as parsing it would find it (None: it has none).

    The fast path reads the id without parsing the line; anything unusual (escapes, the
    key twice, not a string) is parsed in full.
    """
    if b'"request_id"' not in line:
        return f"line-{number}"
    found, rid = quick_id(line)
    if found:
        return rid
    try:
        value = json.loads(line)
    except ValueError:
        return None
    if not isinstance(value, dict):
        return None
    value_id = value.get("request_id", f"line-{number}")
    return value_id if isinstance(value_id, str) else None


class Scan:
    """What one pass over a seekable input found: request lines, ids that may repeat."""

    def __init__(self, total: int, repeated: frozenset[str]) -> None:
        self.total = total
        self.repeated = repeated


def scan(source: BinaryIO, stop: threading.Event) -> Scan | None:
    """Count the request lines of ``source`` and find every id that may occur twice.

    Memory: a fixed-size filter plus the ids it flags (the real duplicates and a few false
    positives). Rewinds ``source``; returns None if ``stop`` was set meanwhile.
    """
    ids = IdFilter()
    repeated: set[str] = set()
    total = 0
    for number, line in enumerate(source, 1):
        if not number & 0xFFF and stop.is_set():
            return None
        if not line.strip():
            continue
        total += 1
        rid = line_id(line, number)
        if rid is not None and ids.add(rid):
            repeated.add(rid)
    source.seek(0)
    return Scan(total, frozenset(repeated))


class LineParser:
    """Turns input lines into requests; refuses a request id seen on an earlier valid line.

    ``repeated`` (from :func:`scan`) holds every id that may occur twice: only those are
    remembered. Without it (an input read once, e.g. stdin) every id is remembered. With
    ``text`` (a tokenizer is there) every line becomes a :class:`TextRequest`; without it a
    line with a text prompt or option is bad.
    """

    def __init__(self, repeated: frozenset[str] | None, *, text: bool = False) -> None:
        self._repeated = repeated
        self._seen: set[str] = set()
        self._text = text

    def parse(self, number: int, line: bytes) -> GenerateRequest | TextRequest:
        """The request on line ``number``; raises :class:`BadLine` naming the problem."""
        value = decode_line(number, line)
        try:
            request = self._request(number, value, self._text)
        except InvalidRequestError as exc:
            raise BadLine(f"line {number}: {exc}") from None
        rid = request.request_id
        if self._repeated is None or rid in self._repeated:
            if rid in self._seen:
                raise BadLine(f"line {number}: "
                              f"{InvalidRequestError('request_id', f'{rid!r} appears twice')}")
            self._seen.add(rid)
        return request

    @staticmethod
    def _request(number: int, value: object, text: bool) -> GenerateRequest | TextRequest:
        if not isinstance(value, dict):
            raise InvalidRequestError("line", "must be a JSON object")
        unknown = set(value) - _KEYS
        if unknown:
            raise InvalidRequestError("line", f"unknown key(s) {', '.join(sorted(unknown))}")
        rid = value.get("request_id", f"line-{number}")
        if not isinstance(rid, str) or not rid:
            raise InvalidRequestError("request_id", "must be a non-empty string")
        sampling = value.get("sampling_params")
        options: dict[str, Any] = {}
        if isinstance(sampling, dict) and not set(_TEXT_SAMPLING_KEYS).isdisjoint(sampling):
            sampling = dict(sampling)
            options = {k: sampling.pop(k) for k in _TEXT_SAMPLING_KEYS if k in sampling}
        params = sampling_from_mapping(sampling)
        texts = [k for k in _TEXT_KEYS if k in value]
        if not text:
            if texts or options:
                raise InvalidRequestError((texts or list(options))[0], NO_TOKENIZER)
            return GenerateRequest(
                request_id=rid, prompt_token_ids=_prompt_token_ids(value),
                sampling_params=params, priority=value.get("priority", 0),
                cache_salt=value.get("cache_salt"))
        if not {"prompt", "messages"} & set(texts):
            value["prompt_token_ids"] = _prompt_token_ids(value)
        request = TextRequest(
            request_id=rid, sampling_params=params, priority=value.get("priority", 0),
            cache_salt=value.get("cache_salt"), **options,
            **{k: value[k] for k in ("prompt_token_ids", *_TEXT_KEYS) if k in value})
        check_text_request(request)
        return request


def _prompt_token_ids(value: dict[str, Any]) -> list[int]:
    prompt = value.get("prompt_token_ids")
    if not isinstance(prompt, list) or not prompt or not all(
            type(t) is int and t >= 0 for t in prompt):
        raise InvalidRequestError("prompt_token_ids",
                                  "must be a non-empty list of non-negative integers")
    return prompt


class LineReader:
    """The lines of ``source`` in batches, each from one read of at most ``chunk`` bytes.

    Reads happen in a worker thread (a pipe may keep them waiting) and return what is there,
    so a slow producer's lines are handled as they come. Lines lose their newline.
    """

    def __init__(self, source: BinaryIO, chunk: int = CHUNK_SIZE) -> None:
        self._source = source
        self._chunk = chunk
        self._rest = b""
        self._eof = False
        self._held: list[bytes] = []

    def _read(self) -> bytes:
        read1 = getattr(self._source, "read1", None)
        data: bytes = read1(self._chunk) if read1 is not None else self._source.read(self._chunk)
        return data

    async def first_line(self) -> bytes | None:
        """The first non-blank line (None if there is none), left for :meth:`next_batch`."""
        held: list[bytes] = []
        try:
            while (batch := await self.next_batch()) is not None:
                held.extend(batch)
                for line in batch:
                    if line.strip():
                        return line
            return None
        finally:
            self._held = held

    async def next_batch(self) -> list[bytes] | None:
        """The next complete lines (the last one may lack its newline); None at the end."""
        if self._held:
            held, self._held = self._held, []
            return held
        while not self._eof:
            chunk = await anyio.to_thread.run_sync(self._read, abandon_on_cancel=True)
            if not chunk:
                self._eof = True
                rest, self._rest = self._rest, b""
                return [rest] if rest else None
            lines = (self._rest + chunk).split(b"\n")
            self._rest = lines.pop()
            if lines:
                return lines
        return None


def open_input(name: str) -> BinaryIO:
    """The input file ``name`` (``-``: stdin), opened for reading.

    Raises :class:`UsageError` (exit status 2, as any usage error) if it cannot be opened:
    a missing file is the caller's mistake, found before anything starts.
    """
    if name == "-":
        return sys.stdin.buffer
    try:
        return open(name, "rb")
    except OSError as exc:
        raise UsageError(f"cannot read the input file {name}: {exc.strerror}") from None


def spool(source: BinaryIO) -> BinaryIO:
    """Copy a read-once input to a temporary file (disk, not memory) to read it twice."""
    spooled = tempfile.TemporaryFile()  # noqa: SIM115 - closed by the caller
    while chunk := source.read(CHUNK_SIZE):
        spooled.write(chunk)
    spooled.seek(0)
    return spooled


def check_all(source: BinaryIO, parser: LineParser, stop: threading.Event) -> int | None:
    """``--strict``: report every bad line (stderr); returns how many, None if stopped."""
    problems = 0
    for number, line in enumerate(source, 1):
        if not number & 0xFFF and stop.is_set():
            return None
        if not line.strip():
            continue
        try:
            parser.parse(number, line)
        except BadLine as exc:
            problems += 1
            print(f"anyio-genout: {exc}", file=sys.stderr)
    source.seek(0)
    return problems


async def in_thread(fn: Any, *args: Any) -> Any:
    """``fn(*args, stop)`` in a worker thread; cancelling sets ``stop`` and leaves it."""
    stop = threading.Event()
    try:
        return await anyio.to_thread.run_sync(lambda: fn(*args, stop), abandon_on_cancel=True)
    finally:
        stop.set()
