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

The round itself is the ``lateness`` cell's of ``nox -s bench``
(:func:`anyio_genout.bench.lateness.lateness_round`); this script runs it against a mock
engine in its own process. A script, not a test: timings depend on the machine and its
load.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

import anyio

from anyio_genout import (
    Client,
    ClientConfig,
    EngineCoreClientConfig,
    HandshakeTransport,
    HealthConfig,
)
from anyio_genout.bench.lateness import lateness_round
from anyio_genout.transport import free_tcp_address


async def one_run(address: str, streams: int, work: float, run: int) -> list[float]:
    config = ClientConfig(engine=EngineCoreClientConfig(
        transport=HandshakeTransport(address), ready_timeout=30,
        health=HealthConfig(liveness_interval=None)), registry=None)
    async with Client.connect(config) as client:
        late, unfinished = await lateness_round(client, streams, 3000, f"r{run}", work=work)
        if client.engine.in_flight:
            raise SystemExit(f"{client.engine.in_flight} request(s) still in flight 30 s "
                             "after their scopes were cancelled")
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
                [sys.executable, "-m", "anyio_genout", "mock-engine",
                 "--handshake-address", address, "--step-time", "0", "--no-log-stats",
                 "--max-model-len", "8192"],
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
