"""``anyio-genout run``: a batch job over a JSONL file of requests.

Each input line is ``{"request_id": ..., "prompt_token_ids": [...], "sampling_params":
{...}}``. Each finished request becomes one output line, written as soon as it finishes, so an
interrupted or failed run keeps every completed result. Exit codes: 0 every request finished,
1 some requests failed or input lines were skipped, 2 bad input with ``--strict``, 130
interrupted (Ctrl-C / SIGTERM: every in-flight request is aborted in the engine first).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import IO, Any

import anyio
import anyio.abc

from ..errors import GenoutError, InvalidRequestError
from ..generate import Client, GenerateRequest
from .engines import ClientSession, interruptible
from .options import add_engine_options, dumps, sampling_from_mapping

__all__ = ["add_parser", "run"]

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 130


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "run", help="run a JSONL file of requests and write JSONL results",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("input", help="JSONL file of requests ('-' for stdin)")
    parser.add_argument("-o", "--output", required=True, help="JSONL file for the results")
    parser.add_argument("--concurrency", type=int, default=64, metavar="N")
    parser.add_argument("--strict", action="store_true",
                        help="refuse to start if any input line is invalid (default: skip it)")
    parser.add_argument("--metrics-port", type=int, metavar="PORT",
                        help="serve the Prometheus metrics over HTTP while running")
    parser.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST",
                        help="interface for --metrics-port (default loopback only)")
    parser.add_argument("--no-progress", action="store_true")
    add_engine_options(parser)
    parser.set_defaults(command=run)


def parse_requests(stream: IO[str]) -> tuple[list[GenerateRequest], list[str]]:
    """Parse every line; returns the requests and one message per bad line."""
    requests: list[GenerateRequest] = []
    problems: list[str] = []
    seen: set[str] = set()
    for number, line in enumerate(stream, 1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
            if not isinstance(value, dict):
                raise InvalidRequestError("line", "must be a JSON object")
            unknown = set(value) - {"request_id", "prompt_token_ids", "sampling_params",
                                    "priority", "cache_salt"}
            if unknown:
                raise InvalidRequestError("line", f"unknown key(s) {', '.join(sorted(unknown))}")
            rid = value.get("request_id", f"line-{number}")
            if not isinstance(rid, str) or not rid:
                raise InvalidRequestError("request_id", "must be a non-empty string")
            if rid in seen:
                raise InvalidRequestError("request_id", f"{rid!r} appears twice")
            prompt = value.get("prompt_token_ids")
            if not isinstance(prompt, list) or not prompt or not all(
                    type(t) is int and t >= 0 for t in prompt):
                raise InvalidRequestError("prompt_token_ids",
                                          "must be a non-empty list of non-negative integers")
            request = GenerateRequest(
                request_id=rid, prompt_token_ids=prompt,
                sampling_params=sampling_from_mapping(value.get("sampling_params")),
                priority=value.get("priority", 0), cache_salt=value.get("cache_salt"))
            seen.add(rid)
            requests.append(request)
        except json.JSONDecodeError as exc:
            problems.append(f"line {number}: not valid JSON ({exc.msg})")
        except InvalidRequestError as exc:
            problems.append(f"line {number}: {exc}")
    return requests, problems


class _Progress:
    def __init__(self, total: int, enabled: bool) -> None:
        self.total = total
        self.done = 0
        self.failed = 0
        self.tokens = 0
        self.started = time.monotonic()
        self.enabled = enabled
        self.tty = sys.stderr.isatty()

    def restart(self) -> None:
        """Start the clock (rates and ETA exclude the wait for engines)."""
        self.started = time.monotonic()

    def line(self) -> str:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        finished = self.done + self.failed
        rate = finished / elapsed
        eta = (self.total - finished) / rate if rate > 0 else math.inf
        eta_text = f"{eta:.0f}s" if math.isfinite(eta) else "?"
        return (f"{self.done}/{self.total} done, {self.failed} failed, "
                f"{self.tokens / elapsed:.0f} tokens/s, ETA {eta_text}")

    async def show(self) -> None:
        if not self.enabled:
            await anyio.sleep_forever()
        while True:
            await anyio.sleep(0.25 if self.tty else 5.0)
            if self.tty:
                print(f"\r{self.line()}\x1b[K", end="", file=sys.stderr, flush=True)
            else:
                print(self.line(), file=sys.stderr, flush=True)


async def run(args: argparse.Namespace) -> int:
    try:
        if args.input == "-":
            requests, problems = parse_requests(sys.stdin)
        else:
            with open(args.input, encoding="utf-8") as fh:  # noqa: ASYNC230 - before any I/O
                requests, problems = parse_requests(fh)
    except OSError as exc:
        raise GenoutError(f"cannot read {args.input}: {exc.strerror}") from None
    for problem in problems:
        print(f"anyio-genout: {problem}", file=sys.stderr)
    if problems and args.strict:
        print(f"anyio-genout: {len(problems)} invalid line(s); nothing was run (--strict)",
              file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.concurrency < 1:
        raise GenoutError("--concurrency must be at least 1")
    try:
        out = open(args.output, "w", encoding="utf-8")  # noqa: SIM115, ASYNC230 - closed below
    except OSError as exc:
        raise GenoutError(f"cannot write {args.output}: {exc.strerror}") from None
    progress = _Progress(len(requests), not args.no_progress)
    failures: list[str] = []
    try:
        # The signal watcher also covers the start-up (e.g. waiting for engines to dial in).
        async with interruptible() as interrupted, ClientSession(args) as client:
            server = None
            if args.metrics_port is not None:
                from prometheus_client import start_http_server

                server = start_http_server(args.metrics_port, addr=args.metrics_host,
                                           registry=client.metrics.registry)
            try:
                progress.restart()
                async with anyio.create_task_group() as tg:
                    tg.start_soon(progress.show)
                    await _run_all(client, requests, args.concurrency, out, progress, failures)
                    tg.cancel_scope.cancel()
            finally:
                if server is not None:
                    server[0].shutdown()
    finally:
        out.close()
        if progress.enabled and progress.tty:
            print(file=sys.stderr)
    print(f"anyio-genout: {progress.line()}", file=sys.stderr)
    for failure in failures[:20]:
        print(f"anyio-genout: failed: {failure}", file=sys.stderr)
    if len(failures) > 20:
        print(f"anyio-genout: ... and {len(failures) - 20} more failed request(s) "
              f"(see their \"error\" lines in {args.output})", file=sys.stderr)
    if interrupted:
        print(f"anyio-genout: interrupted; {progress.done} finished result(s) kept in "
              f"{args.output}", file=sys.stderr)
        return EXIT_INTERRUPTED
    return EXIT_FAILED if failures or problems or progress.done < len(requests) else EXIT_OK


async def _run_all(client: Client, requests: list[GenerateRequest], concurrency: int,
                   out: IO[str], progress: _Progress, failures: list[str]) -> None:
    send, receive = anyio.create_memory_object_stream[GenerateRequest](len(requests) or 1)
    for request in requests:
        send.send_nowait(request)
    send.close()

    async def worker() -> None:
        async for request in receive:
            result = await _run_one(client, request)
            out.write(dumps(result) + "\n")
            out.flush()
            if "error" in result:
                progress.failed += 1
                failures.append(f"{request.request_id}: {result['error']}")
            else:
                progress.done += 1
                progress.tokens += len(result["token_ids"])

    with receive:
        async with anyio.create_task_group() as tg:
            for _ in range(min(concurrency, len(requests))):
                tg.start_soon(worker)


async def _run_one(client: Client, request: GenerateRequest) -> dict[str, Any]:
    arrival = time.time()
    first: float | None = None
    try:
        async with client.generate(request) as stream:
            tokens: list[int] = []
            finish = None
            cached = 0
            async for out in stream:
                if first is None and out.token_ids:
                    first = time.time()
                tokens.extend(out.token_ids)
                cached = max(cached, out.cached_token_count)
                finish = out.finish_reason
    except GenoutError as exc:
        return {"request_id": request.request_id, "error": f"{type(exc).__name__}: {exc}"}
    end = time.time()
    assert finish is not None
    stop = finish.stop_reason
    return {
        "request_id": request.request_id,
        "token_ids": tokens,
        "finish_reason": finish.as_str(),
        "stop_reason": list(stop) if isinstance(stop, tuple) else stop,
        "usage": {"prompt_tokens": len(request.prompt_token_ids),
                  "output_tokens": len(tokens), "cached_tokens": cached},
        "ttft": None if first is None else round(first - arrival, 6),
        "e2e_latency": round(end - arrival, 6),
    }
