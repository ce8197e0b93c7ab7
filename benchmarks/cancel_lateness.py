"""How late a timeout around a busy stream fires: ``move_on_after(0.1)`` around each of N.

Run: ``.venv/bin/python benchmarks/cancel_lateness.py [--streams 256] [--runs 3]
[--backend asyncio|uvloop|trio ...]``.

A mock engine process steps back to back (``--step-time 0``) and N requests of many tokens
stream at once, each read by its own task that spends ``--work`` seconds (default 0.2 ms,
blocking, as a busy consumer does) on every output, inside ``anyio.move_on_after(0.1)``.
No stream can end first. For every scope the lateness is the time from its deadline to the
moment its task was out of the scope; the script prints p50, p99 and max per run, and
checks that every request was aborted (nothing left in flight). Under load from other
processes the figures grow: say so when quoting them.

This is a script, not a test: timings depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import anyio

from anyio_genout import (
    Client,
    ClientConfig,
    EngineCoreClientConfig,
    GenerateRequest,
    SamplingParams,
)
from anyio_genout.transport import free_tcp_address

TIMEOUT = 0.1


async def one_run(address: str, streams: int, work: float, run: int) -> list[float]:
    config = ClientConfig(engine=EngineCoreClientConfig(
        handshake_address=address, ready_timeout=30, liveness_interval=None), registry=None)
    late: list[float] = []
    unfinished = 0

    async def consume(n: int) -> None:
        nonlocal unfinished
        request = GenerateRequest(request_id=f"r{run}-{n}", prompt_token_ids=[1, 2, 3],
                                  sampling_params=SamplingParams(max_tokens=3000,
                                                                 ignore_eos=True))
        with anyio.move_on_after(TIMEOUT) as scope:
            async with client.generate(request) as stream:
                async for _out in stream:
                    time.sleep(work)  # noqa: ASYNC251 - the consumer's own (blocking) work
        late.append(anyio.current_time() - scope.deadline)
        if not scope.cancelled_caught:
            unfinished += 1

    async with Client.connect(config) as client:
        async with anyio.create_task_group() as tg:
            for n in range(streams):
                tg.start_soon(consume, n)
        with anyio.fail_after(30):
            while client.engine.in_flight:  # noqa: ASYNC110 - polling a counter
                await anyio.sleep(0.01)
    if unfinished:
        print(f"  {unfinished} stream(s) ended before the timeout", file=sys.stderr)
    return late


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=256)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--work", type=float, default=0.0002,
                        help="seconds of blocking work per output (default: 0.0002)")
    parser.add_argument("--backend", action="append", choices=["asyncio", "uvloop", "trio"])
    args = parser.parse_args()
    for backend in args.backend or ["asyncio", "uvloop", "trio"]:
        for run in range(args.runs):
            address = free_tcp_address()
            engine = subprocess.Popen(
                [sys.executable, "-m", "anyio_genout.mock", "--handshake-address", address,
                 "--step-time", "0", "--no-log-stats", "--max-model-len", "8192"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
            try:
                name, options = ("asyncio", {"use_uvloop": True}) if backend == "uvloop" \
                    else (backend, {})
                late = anyio.run(one_run, address, args.streams, args.work, run,
                                 backend=name, backend_options=options)
            finally:
                engine.kill()
                engine.wait(10)
            print(f"{backend:8} run {run}: lateness p50 {statistics.median(late) * 1e3:7.1f} ms"
                  f"  p99 {_quantile(late, 0.99) * 1e3:7.1f} ms"
                  f"  max {max(late) * 1e3:7.1f} ms  ({len(late)} scopes)", flush=True)


if __name__ == "__main__":
    main()
