"""``anyio-genout run``: a batch job over a JSONL file of requests.

Each input line is ``{"request_id": ..., "prompt_token_ids": [...], "sampling_params":
{...}}``. Each finished request becomes one output line, written as soon as it finishes, so an
interrupted or failed run keeps every completed result; ``--resume`` then runs only the rest.
The input is read as it is needed: memory stays bounded by --concurrency, whatever its size.
Exit codes: 0 every request finished, 1 some requests failed, input lines were skipped or the
engines died, 2 a usage error or bad input with ``--strict``, 130 interrupted (Ctrl-C /
SIGTERM: every in-flight request is aborted in the engine first).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any, BinaryIO, Final

import anyio
import anyio.abc
import numpy as np

from ..errors import GenoutError, InvalidRequestError, OperationalError, UsageError
from ..generate import Client, GenerateRequest
from ..protocol import Logprobs
from .engines import ClientSession, interruptible
from .options import (
    add_engine_options,
    check_max_tokens,
    dumps,
    positive_int,
    sampling_from_mapping,
)

__all__ = ["BadLine", "DoneIds", "Job", "LineParser", "LineReader", "Scan", "add_parser",
           "read_done", "run", "run_all", "scan"]

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 130

#: Bytes read from the input at a time (one thread hop each).
CHUNK_SIZE: Final = 1 << 16

#: Failed requests named on stderr at the end (the rest are counted).
SHOWN_FAILURES: Final = 20

_KEYS: Final = frozenset({"request_id", "prompt_token_ids", "sampling_params", "priority",
                          "cache_salt"})


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "run", help="run a JSONL file of requests and write JSONL results",
        description=__doc__.split("\n", 2)[2].replace("``", "`") if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("input", help="JSONL file of requests ('-' for stdin)")
    parser.add_argument("-o", "--output", required=True, metavar="FILE",
                        help="JSONL file for the results, rewritten unless --resume; '-' "
                             "writes them to stdout (progress and summary stay on stderr) "
                             "(required)")
    parser.add_argument("--resume", action="store_true",
                        help="keep the finished results already in --output and run only the "
                             "other requests, appending their results; error lines and a "
                             "truncated last line are dropped and run again (default: off)")
    parser.add_argument("--concurrency", type=positive_int, default=64, metavar="N",
                        help="requests in flight at once (default: %(default)s)")
    parser.add_argument("--strict", action="store_true",
                        help="check every input line first and refuse to start if any is "
                             "invalid (default: off, report and skip it)")
    parser.add_argument("--metrics-port", type=int, metavar="PORT",
                        help="serve the Prometheus metrics over HTTP while running "
                             "(default: none)")
    parser.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST",
                        help="interface for --metrics-port (default: %(default)s, loopback "
                             "only)")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress lines while running (default: off)")
    add_engine_options(parser)
    parser.set_defaults(command=run)


# ---------------------------------------------------------------------- reading the input


class BadLine(Exception):
    """An input line that is not a valid request (the message names the problem)."""


class _IdFilter:
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
_ID_KEY: Final = re.compile(rb'"request_id"\s*:\s*"([^"\\]*)"')


def _line_id(line: bytes, number: int) -> str | None:
    """The request id of ``line`` as parsing it would find it (None: it has none).

    The fast path reads the id without parsing the line; anything unusual (escapes, the
    key twice, not a string) is parsed in full.
    """
    if b'"request_id"' not in line:
        return f"line-{number}"
    found = _ID_KEY.findall(line)
    if len(found) == 1:
        try:
            rid: str = found[0].decode()
        except UnicodeDecodeError:
            return None
        return rid
    try:
        value = json.loads(line)
    except ValueError:
        return None
    if not isinstance(value, dict):
        return None
    rid = value.get("request_id", f"line-{number}")
    return rid if isinstance(rid, str) else None


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
    ids = _IdFilter()
    repeated: set[str] = set()
    total = 0
    for number, line in enumerate(source, 1):
        if not number & 0xFFF and stop.is_set():
            return None
        if not line.strip():
            continue
        total += 1
        rid = _line_id(line, number)
        if rid is not None and ids.add(rid):
            repeated.add(rid)
    source.seek(0)
    return Scan(total, frozenset(repeated))


class LineParser:
    """Turns input lines into requests; refuses a request id seen on an earlier valid line.

    ``repeated`` (from :func:`scan`) holds every id that may occur twice: only those are
    remembered. Without it (an input read once, e.g. stdin) every id is remembered.
    """

    def __init__(self, repeated: frozenset[str] | None) -> None:
        self._repeated = repeated
        self._seen: set[str] = set()

    def parse(self, number: int, line: bytes) -> GenerateRequest:
        """The request on line ``number``; raises :class:`BadLine` naming the problem."""
        try:
            value = json.loads(line)
        except UnicodeDecodeError:
            raise BadLine(f"line {number}: not valid UTF-8") from None
        except json.JSONDecodeError as exc:
            raise BadLine(f"line {number}: not valid JSON ({exc.msg})") from None
        try:
            request = self._request(number, value)
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
    def _request(number: int, value: object) -> GenerateRequest:
        if not isinstance(value, dict):
            raise InvalidRequestError("line", "must be a JSON object")
        unknown = set(value) - _KEYS
        if unknown:
            raise InvalidRequestError("line", f"unknown key(s) {', '.join(sorted(unknown))}")
        rid = value.get("request_id", f"line-{number}")
        if not isinstance(rid, str) or not rid:
            raise InvalidRequestError("request_id", "must be a non-empty string")
        prompt = value.get("prompt_token_ids")
        if not isinstance(prompt, list) or not prompt or not all(
                type(t) is int and t >= 0 for t in prompt):
            raise InvalidRequestError("prompt_token_ids",
                                      "must be a non-empty list of non-negative integers")
        return GenerateRequest(
            request_id=rid, prompt_token_ids=prompt,
            sampling_params=sampling_from_mapping(value.get("sampling_params")),
            priority=value.get("priority", 0), cache_salt=value.get("cache_salt"))


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

    def _read(self) -> bytes:
        read1 = getattr(self._source, "read1", None)
        data: bytes = read1(self._chunk) if read1 is not None else self._source.read(self._chunk)
        return data

    async def next_batch(self) -> list[bytes] | None:
        """The next complete lines (the last one may lack its newline); None at the end."""
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


def _open_input(name: str) -> BinaryIO:
    if name == "-":
        return sys.stdin.buffer
    try:
        return open(name, "rb")
    except OSError as exc:
        raise GenoutError(f"cannot read {name}: {exc.strerror}") from None


def _spool(source: BinaryIO) -> BinaryIO:
    """Copy a read-once input to a temporary file (disk, not memory) to read it twice."""
    spooled = tempfile.TemporaryFile()  # noqa: SIM115 - closed by the caller
    while chunk := source.read(CHUNK_SIZE):
        spooled.write(chunk)
    spooled.seek(0)
    return spooled


def _check_all(source: BinaryIO, parser: LineParser, stop: threading.Event) -> int | None:
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


async def _in_thread(fn: Any, *args: Any) -> Any:
    """``fn(*args, stop)`` in a worker thread; cancelling sets ``stop`` and leaves it."""
    stop = threading.Event()
    try:
        return await anyio.to_thread.run_sync(lambda: fn(*args, stop), abandon_on_cancel=True)
    finally:
        stop.set()


# ---------------------------------------------------------------------- resuming


class DoneIds:
    """Request ids with a finished result: 17 bytes each (a 128-bit digest), exact lookups."""

    def __init__(self, digests: bytearray) -> None:
        self._digests = np.frombuffer(digests, dtype="S17")  # a view: no copy
        self._digests.sort()

    @staticmethod
    def digest(request_id: str) -> bytes:
        # The trailing 1 keeps numpy's fixed-width bytes from dropping a trailing NUL.
        return hashlib.blake2b(request_id.encode(), digest_size=16).digest() + b"\x01"

    def __len__(self) -> int:
        return len(self._digests)

    def __contains__(self, request_id: str) -> bool:
        key = self.digest(request_id)
        i = int(np.searchsorted(self._digests, key))
        return i < len(self._digests) and bytes(self._digests[i]) == key


def read_done(path: Path, stop: threading.Event) -> tuple[DoneIds, int] | None:
    """The finished results in ``path``; drops its error lines and a truncated last line.

    Returns the ids and how many lines were dropped (None if ``stop`` was set). A file whose
    only bad line is a truncated last one is truncated in place; otherwise the kept lines are
    copied to a new file that replaces it.
    """
    digests = bytearray()
    dropped = 0
    keep_until = 0  # end of the last kept line, while every line so far was kept
    contiguous = True
    try:
        fh = open(path, "rb")  # noqa: SIM115 - closed below
    except FileNotFoundError:
        return DoneIds(digests), 0  # nothing to resume: a first run
    except OSError as exc:
        raise GenoutError(f"cannot read {path}: {exc.strerror}") from None
    with fh:
        for number, line in enumerate(fh, 1):
            if not number & 0xFFF and stop.is_set():
                return None
            rid = _finished_id(line)
            if rid is None:
                dropped += 1
                if line.endswith(b"\n"):
                    contiguous = False
                continue
            digests += DoneIds.digest(rid)
            if contiguous:
                keep_until += len(line)
    if dropped and contiguous:
        os.truncate(path, keep_until)
    elif dropped:
        temporary = path.with_name(f".{path.name}.resume")
        with open(path, "rb") as fh, open(temporary, "wb") as out:
            for line in fh:
                if _finished_id(line) is not None:
                    out.write(line)
        os.replace(temporary, path)
    return DoneIds(digests), dropped


def _finished_id(line: bytes) -> str | None:
    """The request id of a finished result line; None for an error or a partial line."""
    if not line.endswith(b"\n"):
        return None
    if b'"error"' not in line and line.startswith(b"{") and line.endswith(b"}\n"):
        # As run writes it: one write per line, so a complete line is a whole JSON object.
        found = _ID_KEY.findall(line)
        if len(found) == 1:
            try:
                rid: str = found[0].decode()
            except UnicodeDecodeError:
                return None
            return rid
    try:
        value = json.loads(line)
    except ValueError:
        return None
    if not isinstance(value, dict) or "error" in value:
        return None
    found_id = value.get("request_id")
    return found_id if isinstance(found_id, str) else None


# ---------------------------------------------------------------------- the job


class Job:
    """The counts of a run, its progress lines and its closing report."""

    def __init__(self, enabled: bool) -> None:
        self.total: int | None = None
        self.done = 0  # finished, this run and (resumed) earlier ones
        self.resumed = 0
        self.failed = 0
        self.skipped = 0
        self.tokens = 0
        self.failures: list[str] = []
        self.engine_failures = 0
        self.death: OperationalError | None = None
        self.started = time.monotonic()
        self.enabled = enabled
        self.tty = sys.stderr.isatty()

    def restart(self) -> None:
        """Start the clock (rates and ETA exclude the wait for engines)."""
        self.started = time.monotonic()

    def skip(self, problem: str) -> None:
        self.skipped += 1
        print(f"anyio-genout: {problem}", file=sys.stderr, flush=True)

    def fail(self, request_id: str, error: str, *, engine_dead: bool) -> None:
        self.failed += 1
        if engine_dead:
            self.engine_failures += 1  # counted; the closing error line says why
        elif len(self.failures) < SHOWN_FAILURES:
            self.failures.append(f"{request_id}: {error}")

    @property
    def unaccounted(self) -> int | None:
        """Request lines with no outcome yet (None if the total is unknown)."""
        if self.total is None:
            return None
        return max(self.total - self.done - self.failed - self.skipped, 0)

    def line(self) -> str:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        finished = self.done - self.resumed + self.failed
        rate = finished / elapsed
        of = "" if self.total is None else f"/{self.total}"
        text = (f"{self.done}{of} done, {self.failed} failed, {self.skipped} skipped, "
                f"{self.tokens / elapsed:.0f} tokens/s")
        left = self.unaccounted
        if left is not None:
            eta = left / rate if rate > 0 else math.inf
            text += f", ETA {eta:.0f}s" if math.isfinite(eta) else ", ETA ?"
        return text

    async def show(self) -> None:
        if not self.enabled:
            await anyio.sleep_forever()
        while True:
            await anyio.sleep(0.25 if self.tty else 5.0)
            if self.tty:
                print(f"\r{self.line()}\x1b[K", end="", file=sys.stderr, flush=True)
            else:
                print(self.line(), file=sys.stderr, flush=True)

    def end_progress(self) -> None:
        if self.enabled and self.tty:
            print(file=sys.stderr)

    def report(self, output: str, interrupted: bool) -> int:
        """The closing lines on stderr; returns the exit code, which agrees with them."""
        where = "stdout" if output == "-" else output
        say = ("anyio-genout: " + self.line().rsplit(", ETA", 1)[0]
               + (f" ({self.resumed} kept from an earlier run)" if self.resumed else ""))
        print(say, file=sys.stderr)
        for failure in self.failures:
            print(f"anyio-genout: failed: {failure}", file=sys.stderr)
        hidden = self.failed - self.engine_failures - len(self.failures)
        if hidden > 0:
            print(f"anyio-genout: ... and {hidden} more failed request(s) (see their "
                  f"\"error\" lines in {where})", file=sys.stderr)
        if interrupted:
            print(f"anyio-genout: interrupted; {self.done - self.resumed} finished result(s) "
                  f"kept in {where}", file=sys.stderr)
            return EXIT_INTERRUPTED
        if self.death is not None:
            left = self.unaccounted
            rest = ("the rest of the input was not run" if left is None else
                    f"{left} request(s) not run")
            print(f"anyio-genout: error: {type(self.death).__name__}: {self.death} "
                  f"({self.engine_failures} in flight failed, {rest}; run again with "
                  f"--resume to finish)", file=sys.stderr)
            return EXIT_FAILED
        if self.failed or self.skipped or self.unaccounted:
            return EXIT_FAILED
        return EXIT_OK


async def run(args: argparse.Namespace) -> int:
    if args.resume and args.output == "-":
        raise UsageError("--resume needs an output file (it reads what an earlier run wrote)")
    source = _open_input(args.input)
    try:
        if args.strict and not source.seekable():
            # --strict reads the input twice: a pipe is copied to a temporary file first.
            spooled = await anyio.to_thread.run_sync(_spool, source, abandon_on_cancel=True)
            with spooled:
                return await _run(args, spooled)
        return await _run(args, source)
    finally:
        if source is not sys.stdin.buffer:
            source.close()


async def _run(args: argparse.Namespace, source: BinaryIO) -> int:
    job = Job(not args.no_progress)
    out: IO[str] | None = None
    try:
        # The signal watcher also covers the scans and the start-up (waiting for engines).
        async with interruptible() as interrupted:
            repeated = None
            if source.seekable():
                found: Scan = await _in_thread(scan, source)
                job.total, repeated = found.total, found.repeated
            parser = LineParser(repeated)
            if args.strict:
                problems = await _in_thread(_check_all, source, LineParser(repeated))
                if problems:
                    print(f"anyio-genout: {problems} invalid line(s); nothing was run "
                          "(--strict)", file=sys.stderr)
                    return EXIT_BAD_INPUT
            done: DoneIds | None = None
            if args.resume:
                done, dropped = await _in_thread(read_done, Path(args.output))
                print(f"anyio-genout: resuming: {len(done)} finished result(s) in "
                      f"{args.output} kept" + (f", {dropped} error or truncated line(s) "
                                                "dropped to run again" if dropped else ""),
                      file=sys.stderr)
            out = _open_output(args.output, append=done is not None)
            async with ClientSession(args) as client:
                await _serve(args, client, source, parser, done, out, job)
    finally:
        if out is sys.stdout:
            out.flush()
        elif out is not None:
            out.close()
        job.end_progress()
    return job.report(args.output, bool(interrupted))


def _open_output(name: str, *, append: bool) -> IO[str]:
    if name == "-":
        return sys.stdout
    try:
        return open(name, "a" if append else "w", encoding="utf-8")
    except OSError as exc:
        raise GenoutError(f"cannot write {name}: {exc.strerror}") from None


async def _serve(args: argparse.Namespace, client: Client, source: BinaryIO,
                 parser: LineParser, done: DoneIds | None, out: IO[str], job: Job) -> None:
    server = None
    if args.metrics_port is not None:
        from prometheus_client import start_http_server

        server = start_http_server(args.metrics_port, addr=args.metrics_host,
                                   registry=client.metrics.registry)
    try:
        job.restart()
        async with anyio.create_task_group() as tg:
            tg.start_soon(job.show)
            await run_all(client, LineReader(source), parser, done, args.concurrency, out, job)
            tg.cancel_scope.cancel()
    finally:
        if server is not None:
            server[0].shutdown()


async def run_all(client: Client, lines: LineReader, parser: LineParser,
                   done: DoneIds | None, concurrency: int, out: IO[str], job: Job) -> None:
    """Feed parsed requests to ``concurrency`` workers, one at a time as they free up.

    The feeder holds at most one parsed request beyond those in flight (the channel has no
    buffer). When the engines die the feeder stops: requests in flight end with an error
    line, the ones not started have no line (``--resume`` runs them).
    """
    send, receive = anyio.create_memory_object_stream[GenerateRequest](0)
    feeder = anyio.CancelScope()
    engine = client.engine

    def stop_if_dead() -> bool:
        if engine.is_healthy:
            return False
        job.death = job.death or engine.health_error
        feeder.cancel()
        return True

    async def feed() -> None:
        with feeder, send:
            number = 0
            while (batch := await lines.next_batch()) is not None:
                for line in batch:
                    number += 1
                    if not line.strip():
                        continue
                    if done is not None and (rid := _line_id(line, number)) is not None \
                            and rid in done:
                        job.done += 1  # finished in an earlier run: not even parsed
                        job.resumed += 1
                        continue
                    try:
                        request = parser.parse(number, line)
                    except BadLine as exc:
                        job.skip(str(exc))
                        continue
                    try:
                        # A worker is waiting: hand it over without a pass of the event loop,
                        # so a wave of requests reaches the engine together.
                        send.send_nowait(request)
                    except anyio.WouldBlock:
                        await send.send(request)

    async def work() -> None:
        async for request in receive:
            if stop_if_dead():
                return  # not started: no line
            result = await _run_one(client, request)
            out.write(dumps(result) + "\n")
            out.flush()
            if "error" in result:
                job.fail(request.request_id, result["error"], engine_dead=stop_if_dead())
            else:
                job.done += 1
                job.tokens += len(result["token_ids"])

    with receive:
        async with anyio.create_task_group() as tg:
            tg.start_soon(feed)
            for _ in range(concurrency):
                tg.start_soon(work)
    stop_if_dead()


async def _run_one(client: Client, request: GenerateRequest) -> dict[str, Any]:
    arrival = time.time()
    first: float | None = None
    logprobs: list[Logprobs] = []
    try:
        check_max_tokens(len(request.prompt_token_ids), request.sampling_params.max_tokens,
                         client.engine.max_model_len)
        async with client.generate(request) as stream:
            tokens: list[int] = []
            finish = None
            cached = 0
            async for out in stream:
                if first is None and out.token_ids:
                    first = time.time()
                tokens.extend(out.token_ids)
                if out.logprobs is not None:
                    logprobs.append(out.logprobs)
                cached = max(cached, out.cached_token_count)
                finish = out.finish_reason
    except GenoutError as exc:
        return {"request_id": request.request_id, "error": f"{type(exc).__name__}: {exc}"}
    end = time.time()
    assert finish is not None
    stop = finish.stop_reason
    result: dict[str, Any] = {
        "request_id": request.request_id,
        "token_ids": tokens,
        "finish_reason": finish.as_str(),
        "stop_reason": list(stop) if isinstance(stop, tuple) else stop,
        "usage": {"prompt_tokens": len(request.prompt_token_ids),
                  "output_tokens": len(tokens), "cached_tokens": cached},
        "ttft": None if first is None else round(first - arrival, 6),
        "e2e_latency": round(end - arrival, 6),
    }
    if request.sampling_params.logprobs is not None:
        result["logprobs"] = _logprob_rows(Logprobs.concat(logprobs))
    return result


def _logprob_rows(logprobs: Logprobs | None) -> list[list[list[float | int]]]:
    """Per generated token: ``[token_id, logprob, rank]`` for the sampled one, then the top N."""
    if logprobs is None:
        return []
    return [[[entry.token_id, round(entry.logprob, 6), entry.rank] for entry in position]
            for position in logprobs.positions]
