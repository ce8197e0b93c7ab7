"""``anyio-genout run``'s results: one request's result line, the counts and the report.

:func:`run_one` runs one request and makes its output line (a result, or its error);
:class:`Job` counts the outcomes, shows progress on stderr and writes the closing report,
whose exit code agrees with it.
"""

from __future__ import annotations

import math
import sys
import time
from typing import IO, Any, Final

import anyio
import attrs

from ..errors import GenoutError, OperationalError
from ..generate import Client, FinishReason, GenerateRequest
from ..protocol import Logprobs
from ..text.client import TextClient
from ..text.output import TokenLogprob
from ..text.request import TextRequest

__all__ = ["EXIT_BAD_INPUT", "EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_OK", "SHOWN_FAILURES",
           "Job", "logprob_rows", "open_output", "run_one"]

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 130


#: Failed requests named on stderr at the end (the rest are counted).
SHOWN_FAILURES: Final = 20


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


def open_output(name: str, *, append: bool) -> IO[str]:
    if name == "-":
        return sys.stdout
    try:
        return open(name, "a" if append else "w", encoding="utf-8")
    except OSError as exc:
        raise GenoutError(f"cannot write {name}: {exc.strerror}") from None


async def run_one(client: Client, request: GenerateRequest | TextRequest,
                  text_client: TextClient | None = None) -> dict[str, Any]:
    """Run ``request`` (a :class:`TextRequest` needs ``text_client``) and make its result
    line, or its error line."""
    if isinstance(request, TextRequest):
        assert text_client is not None
        return await _run_text(client, text_client, request)
    arrival = time.time()
    first: float | None = None
    logprobs: list[Logprobs] = []
    try:
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
    result = _result(request.request_id, None, tokens, finish, len(request.prompt_token_ids),
                     cached, first, arrival, end)
    if request.sampling_params.logprobs is not None:
        result["logprobs"] = logprob_rows(Logprobs.concat(logprobs))
    return result


async def _run_text(client: Client, text_client: TextClient,
                    request: TextRequest) -> dict[str, Any]:
    arrival = time.time()
    first: float | None = None
    logprobs: list[list[TokenLogprob]] = []
    texts: list[str] = []
    try:
        # Encoded here, once (off the loop, as entering does): the stream then sends these
        # ids; max_tokens is checked by the engine client, as for every request.
        _, ids = await text_client.encode(request)
        if request.prompt_token_ids is None and ids:  # none: entering refuses it
            request = attrs.evolve(request, prompt=None, messages=None, prompt_token_ids=ids)
        async with text_client.generate(request) as stream:
            tokens: list[int] = []
            finish = None
            cached = 0
            async for out in stream:
                if first is None and out.token_ids:
                    first = time.time()
                texts.append(out.text)
                tokens.extend(out.token_ids)
                if out.logprobs is not None:
                    logprobs.extend(out.logprobs)
                cached = max(cached, out.cached_token_count)
                finish = out.finish_reason
    except GenoutError as exc:
        return {"request_id": request.request_id, "error": f"{type(exc).__name__}: {exc}"}
    end = time.time()
    assert finish is not None
    result = _result(request.request_id, "".join(texts), tokens, finish, len(ids), cached,
                     first, arrival, end)
    if request.sampling_params.logprobs is not None:
        result["logprobs"] = [[[entry.token_id, round(entry.logprob, 6), entry.rank]
                               for entry in position] for position in logprobs]
    return result


def _result(request_id: str, text: str | None, tokens: list[int], finish: FinishReason,
            prompt_len: int, cached: int, first: float | None, arrival: float,
            end: float) -> dict[str, Any]:
    stop = finish.stop_reason
    result: dict[str, Any] = {"request_id": request_id}
    if text is not None:
        result["text"] = text
    result.update({
        "token_ids": tokens,
        "finish_reason": finish.as_str(),
        "stop_reason": list(stop) if isinstance(stop, tuple) else stop,
        "usage": {"prompt_tokens": prompt_len, "output_tokens": len(tokens),
                  "cached_tokens": cached},
        "ttft": None if first is None else round(first - arrival, 6),
        "e2e_latency": round(end - arrival, 6),
    })
    return result


def logprob_rows(logprobs: Logprobs | None) -> list[list[list[float | int]]]:
    """Per generated token: ``[token_id, logprob, rank]`` for the sampled one, then the top N."""
    if logprobs is None:
        return []
    return [[[entry.token_id, round(entry.logprob, 6), entry.rank] for entry in position]
            for position in logprobs.positions]
