"""The workloads on our :class:`~anyio_genout.Client` (asyncio, asyncio+uvloop or trio).

Every request is consumed the way an application would:
``async with client.generate(request) as stream: async for out in stream``, and building the
:class:`~anyio_genout.GenerateRequest` counts as client work.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from .. import (
    Client,
    ClientConfig,
    EngineCoreClientConfig,
    GenerateRequest,
    HandshakeTransport,
    SamplingParams,
)
from .lateness import run_lateness
from .measure import EngineProcess, Meter, free_port, freeze_gc, rss_bytes
from .spec import CellSpec, Result, percentile, summarise

__all__ = ["churn_params", "prompt", "run", "run_churn", "run_streams"]


def prompt(length: int, seed: int = 0) -> tuple[int, ...]:
    """A deterministic prompt of ``length`` token ids, all ordinary tokens of the tiny model
    (vocabulary 1024, ids 0-3 special) that the vLLM reference loads."""
    return tuple(4 + (seed * 7919 + i * 104729) % 1000 for i in range(length))


def run(spec: CellSpec) -> Result:
    """Start the engine, connect, warm up, freeze the GC heap, measure ``spec``."""
    address = f"tcp://127.0.0.1:{free_port()}"
    with EngineProcess(address, spec) as engine:
        backend, options = spec.backend, {}
        if backend == "uvloop":
            backend, options = "asyncio", {"use_uvloop": True}
        result: Result = anyio.run(_main, spec, engine, address, backend=backend,
                                   backend_options=options)
        engine.check_alive()
        return result


async def _main(spec: CellSpec, engine: EngineProcess, address: str) -> Result:
    config = ClientConfig(engine=EngineCoreClientConfig(transport=HandshakeTransport(address),
                                                        ready_timeout=60.0))
    async with Client.connect(config) as client:
        await _warm_up(client, spec)
        frozen = freeze_gc()
        meter = Meter(spec, engine)
        body = _WORKLOADS[spec.workload]
        profiler: Any = None
        if spec.profile:
            from pyinstrument import Profiler

            profiler = Profiler(interval=0.0005, async_mode="disabled")
            profiler.start()
        try:
            extra = await body(client, spec, meter)
        finally:
            if profiler is not None:
                profiler.stop()
        if profiler is not None and spec.profile is not None:
            from .profile import write_profile

            extra["profile"] = write_profile(profiler, spec.profile)
    result = summarise(spec, meter.samples, meter.window()) if meter.samples else {}
    result.update(extra)
    result["gc_frozen_objects"] = frozen
    result["gc_collections"] = [s["collections"] for s in gc.get_stats()]
    return result


async def _warm_up(client: Client, spec: CellSpec) -> None:
    """A few requests through every code path, so imports and caches are not measured."""
    await run_streams(client, min(spec.concurrency, 64) if spec.workload != "memory" else 16, 8,
                   prompt(spec.prompt_len, 1), "warm")


async def run_streams(client: Client, count: int, tokens: int, ids: tuple[int, ...],
                   tag: str, *, release: bool = False) -> int:
    """``count`` concurrent streams of ``tokens`` tokens each; returns tokens delivered.

    ``release``: the engine's scheduler was paused (see :func:`_gated`); resume it once every
    request has been sent, so that each engine step carries all ``count`` streams.
    """
    delivered = 0
    entered = 0
    all_in = anyio.Event()
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0)

    async def one(i: int) -> None:
        nonlocal delivered, entered
        n = 0
        request = GenerateRequest(request_id=f"{tag}-{i}", prompt_token_ids=ids,
                                  sampling_params=params)
        async with client.generate(request) as stream:
            entered += 1
            if entered == count:
                all_in.set()
            async for out in stream:
                n += len(out.token_ids)
        delivered += n

    async with anyio.create_task_group() as tg:
        for i in range(count):
            tg.start_soon(one, i)
        if release:
            await all_in.wait()
            await client.engine.resume_scheduler()
    return delivered


def gate_rounds(spec: CellSpec) -> bool:
    """Whether a throughput round pauses the engine until all its requests are in.

    The mock engine steps in microseconds, so without the gate it would run the first
    requests of a round to completion while the client is still sending the rest, and how
    many streams share a step (one message) would depend on how fast each client sends and
    on the machine's load, not on the concurrency asked for. A real engine's step takes
    milliseconds and batches them all; the gate reproduces that (a pause costs one utility
    call before the round, a resume one inside it).
    """
    return spec.concurrency > 1


async def _throughput(client: Client, spec: CellSpec, meter: Meter) -> Result:
    ids = prompt(spec.prompt_len)
    expected = spec.concurrency * spec.tokens
    complete = True
    rounds = 0
    gate = gate_rounds(spec)
    while meter.more():
        if gate:
            await client.engine.pause_scheduler("keep", False)
        started = meter.start()
        tokens = await run_streams(client, spec.concurrency, spec.tokens, ids, f"t{rounds}",
                                release=gate)
        meter.stop(started, tokens=tokens, requests=spec.concurrency)
        complete = complete and tokens == expected
        rounds += 1
    result: Result = {"complete": complete}
    result.update(await _batching(client, spec, ids))
    return result


async def _batching(client: Client, spec: CellSpec, ids: tuple[int, ...]) -> Result:
    """One more (unmeasured) round counting the engine messages the reader handled.

    The engine sends one message per step for all its running requests, so how many
    outputs share a message depends on how fast requests reach it: per-message costs are
    amortised over that many outputs.
    """
    messages = 0
    counting = True

    def count(_engine: int, _tokens: int) -> None:  # once per message with outputs
        nonlocal messages
        if counting:
            messages += 1

    client.engine.add_batch_listener(count)  # stays on the client, idle after this round
    gate = gate_rounds(spec)
    if gate:
        await client.engine.pause_scheduler("keep", False)
    try:
        tokens = await run_streams(client, spec.concurrency, spec.tokens, ids, "count",
                                   release=gate)
    finally:
        counting = False
    return {"messages_per_round": messages, "gated": gate,
            "outputs_per_message": tokens / messages if messages else None}


async def _latency(client: Client, spec: CellSpec, meter: Meter) -> Result:
    """One request at a time on a paced engine (every output arrives on its own).

    Measures ``generate()`` entry to the first output (wall time) and, per later output, the
    main thread's CPU time spent since the previous output: the cost of delivering one output
    to an otherwise idle client (waiting in the event loop costs no CPU).
    """
    ids = prompt(spec.prompt_len)
    params = SamplingParams(max_tokens=spec.tokens, ignore_eos=True, temperature=0.0)
    first: list[float] = []
    per_output: list[float] = []
    clock, cpu_clock = time.perf_counter, time.thread_time
    count = spec.requests or 100
    pause = 2 * spec.engine_step_time
    tokens = 0
    for i in range(count):
        await anyio.sleep(pause)  # the engine's pacing must not delay the next first step
        started = meter.start()
        t0 = clock()
        request = GenerateRequest(request_id=f"l{i}", prompt_token_ids=ids,
                                  sampling_params=params)
        previous = 0.0
        n = 0
        async with client.generate(request) as stream:
            async for out in stream:
                now = cpu_clock()
                if previous:
                    per_output.append(now - previous)
                else:
                    first.append(clock() - t0)
                previous = now
                n += len(out.token_ids)
        meter.stop(started, tokens=n, requests=1)
        tokens += n
    return latency_figures(first, per_output, complete=tokens == count * spec.tokens)


def latency_figures(first: list[float], per_output: list[float], *, complete: bool) -> Result:
    return {
        "complete": complete,
        "first_output_p50_us": percentile(first, 50) * 1e6,
        "first_output_p99_us": percentile(first, 99) * 1e6,
        "per_output_cpu_p50_us": percentile(per_output, 50) * 1e6,
        "per_output_cpu_p99_us": percentile(per_output, 99) * 1e6,
    }


def churn_params() -> list[SamplingParams]:
    """The churn workload's sampling parameters: request ``k`` asks for ``1 + k % 4`` tokens."""
    return [SamplingParams(max_tokens=t, ignore_eos=True, temperature=0.0)
            for t in (1, 2, 3, 4)]


async def run_churn(client: Client, total: int, concurrency: int, ids: tuple[int, ...],
                    params: list[SamplingParams], tag: str) -> int:
    """``total`` short requests, ``concurrency`` worker tasks each running one after another
    (request ``k`` with ``params[k % 4]``); returns the tokens delivered."""
    next_index = 0
    delivered = 0

    async def worker() -> None:
        nonlocal next_index, delivered
        while next_index < total:
            k = next_index
            next_index += 1
            request = GenerateRequest(request_id=f"{tag}-{k}", prompt_token_ids=ids,
                                      sampling_params=params[k % 4])
            async with client.generate(request) as stream:
                async for out in stream:
                    delivered += len(out.token_ids)

    async with anyio.create_task_group() as tg:
        for _ in range(concurrency):
            tg.start_soon(worker)
    return delivered


async def _churn(client: Client, spec: CellSpec, meter: Meter) -> Result:
    """``requests`` short requests (1..4 tokens) per round, ``concurrency`` at a time."""
    ids = prompt(spec.prompt_len)
    params = churn_params()
    total = spec.requests or 2000
    expected = sum(1 + k % 4 for k in range(total))
    complete = True
    rounds = 0
    while meter.more():
        started = meter.start()
        delivered = await run_churn(client, total, spec.concurrency, ids, params, f"c{rounds}")
        meter.stop(started, tokens=delivered, requests=total)
        complete = complete and delivered == expected
        rounds += 1
    return {"complete": complete}


async def _memory(client: Client, spec: CellSpec, meter: Meter) -> Result:
    """``requests`` streams in flight at once (the engine runs a few, slowly): RSS each."""
    count = spec.requests or 10_000
    ids = prompt(spec.prompt_len)
    params = SamplingParams(max_tokens=spec.tokens, ignore_eos=True, temperature=0.0)
    base = rss_bytes()
    entered = 0
    errors: list[str] = []
    all_in = anyio.Event()

    async def one(i: int) -> None:
        nonlocal entered
        request = GenerateRequest(request_id=f"m{i}", prompt_token_ids=ids,
                                  sampling_params=params)
        try:
            async with client.generate(request) as stream:
                entered += 1
                if entered == count:
                    all_in.set()
                async for _ in stream:
                    pass
        except Exception as exc:  # reported, not raised: the figure is what matters
            errors.append(repr(exc))
            all_in.set()

    started = meter.start()
    held = 0.0
    peak_inflight = 0
    async with anyio.create_task_group() as tg:
        for i in range(count):
            tg.start_soon(one, i)
        with anyio.move_on_after(60):
            await all_in.wait()
        peak_inflight = client.engine.in_flight
        # Let the engine step a little with everything queued, then hold for a moment.
        await anyio.sleep(0.5)
        inflight_after_hold = client.engine.in_flight
        rss = rss_bytes()
        held = time.perf_counter()
        tg.cancel_scope.cancel()
    meter.stop(started, requests=count)
    cancel_s = time.perf_counter() - held
    delta = rss - base
    return {
        "inflight": peak_inflight,
        "inflight_after_hold": inflight_after_hold,
        "entered": entered,
        "errors": errors[:3],
        "rss_base_bytes": base,
        "rss_inflight_bytes": rss,
        "rss_delta_bytes": delta,
        "bytes_per_request": delta / count,
        "cancel_all_s": cancel_s,
        "held": peak_inflight >= count and not errors,
    }


Workload = Callable[[Client, CellSpec, Meter], Awaitable[Result]]
_WORKLOADS: dict[str, Workload] = {
    "throughput": _throughput,
    "latency": _latency,
    "churn": _churn,
    "memory": _memory,
    "lateness": run_lateness,
}
