"""The lateness cell: how late a timeout around a busy stream fires, under saturation.

``benchmarks/cancel_lateness.py`` as a cell of ``anyio-genout bench``: ``concurrency``
(256) streams of long requests at once from a mock engine stepping back to back, each read
by its own task that spends ``WORK`` (0.2 ms, blocking, as a busy consumer does) on every
output, inside ``anyio.move_on_after(TIMEOUT)``. No stream can end first, so every scope is
cancelled by its deadline; its lateness is the time from that deadline to the moment its
task was out of the scope. ``rounds`` rounds; the cell reports p50, p99 and max over every
scope of every round, and the worst round's max (the target holds "in every run").
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Final

import anyio

from .. import Client, GenerateRequest, SamplingParams
from .spec import CellSpec, Result, percentile

if TYPE_CHECKING:
    from .measure import Meter

__all__ = ["LATENESS_MAX_MS", "LATENESS_P99_MS", "TIMEOUT", "WORK", "lateness_round",
           "run_lateness"]

#: The timeout around each stream, and each consumer's blocking work per output (seconds).
TIMEOUT: Final = 0.1
WORK: Final = 0.0002
#: Targets (issue 23 item 3): on every backend, in every run.
LATENESS_P99_MS: Final = 50.0
LATENESS_MAX_MS: Final = 100.0


async def lateness_round(client: Client, streams: int, tokens: int, tag: str, *,
                         work: float = WORK) -> tuple[list[float], int]:
    """One round: ``streams`` requests of ``tokens`` tokens at once (ids ``{tag}-{n}``), each
    consumed with ``work`` seconds of blocking work per output inside
    ``move_on_after(TIMEOUT)``; returns every scope's lateness (seconds after its deadline)
    and how many streams ended before it. Waits (30 s at most) until the client has no
    request in flight and the engine's outputs sent before its aborts have all been read."""
    late: list[float] = []
    unfinished = 0
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0)

    async def consume(n: int) -> None:
        nonlocal unfinished
        request = GenerateRequest(request_id=f"{tag}-{n}", prompt_token_ids=[5, 6, 7],
                                  sampling_params=params)
        with anyio.move_on_after(TIMEOUT) as scope:
            async with client.generate(request) as stream:
                async for _out in stream:
                    time.sleep(work)  # noqa: ASYNC251 - the consumer's own blocking work
        late.append(anyio.current_time() - scope.deadline)
        if not scope.cancelled_caught:
            unfinished += 1

    async with anyio.create_task_group() as tg:
        for n in range(streams):
            tg.start_soon(consume, n)
    with anyio.move_on_after(30):
        while client.engine.in_flight:  # noqa: ASYNC110 - polling a counter
            await anyio.sleep(0.01)
        # The engine's outputs come in order: once a new request's come back, so has every
        # message it sent before the aborts reached it. So the next round starts as the
        # first one did, not behind a backlog that keeps its consumers idle until their
        # deadlines (an easy round: 1-7 ms late where a real one was 20-50).
        settle = GenerateRequest(request_id=f"{tag}-settle", prompt_token_ids=[5, 6, 7],
                                 sampling_params=SamplingParams(max_tokens=1))
        async with client.generate(settle) as stream:
            async for _out in stream:
                pass
    return late, unfinished


async def run_lateness(client: Client, spec: CellSpec, meter: Meter) -> Result:
    """``spec.min_rounds`` rounds of ``spec.concurrency`` busy streams under a timeout."""
    every: list[float] = []
    worst = 0.0
    unfinished = 0
    for n in range(max(1, spec.min_rounds)):
        started = meter.start()
        late, left = await lateness_round(client, spec.concurrency, spec.tokens, f"late{n}")
        meter.stop(started, requests=len(late))
        every += late
        worst = max(worst, max(late, default=0.0))
        unfinished += left
    p99 = percentile(every, 99) * 1e3
    return {
        "complete": unfinished == 0,
        "lateness_p50_ms": percentile(every, 50) * 1e3,
        "lateness_p99_ms": p99,
        "lateness_max_ms": max(every, default=0.0) * 1e3,
        "lateness_worst_round_max_ms": worst * 1e3,
        "scopes": len(every),
        "ended_first": unfinished,
        "lateness_target_met": p99 <= LATENESS_P99_MS and worst * 1e3 <= LATENESS_MAX_MS,
    }
