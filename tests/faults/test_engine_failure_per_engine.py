"""Per-engine failure (issue #16): four engines, one dies, the other three serve on.

Four in-process mock engines behind one generate :class:`Client` run 400 greedy streams;
engine 2 dies mid-stream in each of the ways an engine can (``ENGINE_CORE_DEAD``, its task
cancelled with its sockets closed, silence found by the liveness check). With the default
``engine_failure="engine"`` only engine 2's requests fail, each with one
:class:`EngineDeadError` naming it; every other stream ends with exactly the tokens an
undisturbed run gives (the mock is deterministic for greedy requests); new requests go to
the live engines only, and one pinned to engine 2 fails at once. With
``engine_failure="client"`` the first death fails everything, and the requests it ends are
aborted on the engines that live.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio
import attrs
import pytest
from prometheus_client import generate_latest

from anyio_genout import (
    Client,
    EngineDeadError,
    GenerateRequest,
    HealthConfig,
    UtilityCallError,
)
from anyio_genout.mock import MockFaults
from tests.cluster import MockCluster, generate_client
from tests.faults.support import generate_request
from tests.support import wait_until

pytestmark = pytest.mark.anyio

ENGINES = 4
VICTIM = 2
STREAMS = 400
AFTER = 40  # new requests once the victim is down

#: rid -> tokens of an undisturbed run (greedy: the same on every backend), filled once.
_REFERENCE: dict[str, list[int]] = {}


@attrs.define
class Outcome:
    engine: int
    tokens: list[int]
    error: BaseException | None = None


def _requests(wave: str, count: int) -> list[GenerateRequest]:
    # Mostly short streams; every 50th is long enough to stream across the death.
    return [generate_request(f"{wave}-{i}", prompt=(1 + i, 2 + i % 7, 3),
                             max_tokens=80 if i % 50 == 0 else 6 + i % 10)
            for i in range(count)]


WAVE = _requests("w", STREAMS)
LATER = _requests("later", AFTER)


def settings(victim_faults: MockFaults | None = None, *,
             mock: dict[str, Any] | None = None, health: dict[str, Any] | None = None,
             **config: Any) -> dict[str, Any]:
    """:func:`generate_client`'s settings for this suite: ``ENGINES`` engines, engine
    ``VICTIM`` with ``victim_faults``; ``mock``: more MockEngineConfig settings; ``health``:
    more HealthConfig settings; the rest: EngineCoreClientConfig settings, or ``generate``
    (ClientConfig settings)."""
    # Only the silent engine needs the liveness check (short here; on a loaded machine a
    # short timeout could flag a live engine, so the other cases turn it off).
    return {"engines": ENGINES, "mock": {"step_time": 0.01, "linger": 0.0, **(mock or {})},
            "overrides": {VICTIM: {"faults": victim_faults}} if victim_faults else {},
            "health": HealthConfig(**{"disconnect_grace": 0.5, "liveness_interval": 0.2,
                                      "liveness_timeout": 1.0, **(health or {})}),
            **config}


async def run_wave(client: Client, requests: Sequence[GenerateRequest],
                   started: anyio.Event | None = None) -> dict[str, Outcome]:
    """Every request as one stream; each ends with its tokens, or its one error."""
    outcomes: dict[str, Outcome] = {}

    async def one(request: GenerateRequest) -> None:
        async with client.generate(request) as stream:
            outcome = outcomes[request.request_id] = Outcome(stream.engine_index, [])
            try:
                async for out in stream:
                    outcome.tokens.extend(out.token_ids)
            except EngineDeadError as exc:
                outcome.error = exc
            with pytest.raises(StopAsyncIteration):  # one error, then the end
                await stream.__anext__()

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            for request in requests:
                tg.start_soon(one, request)
            if started is not None:
                started.set()
    return outcomes


async def reference() -> dict[str, list[int]]:
    """The tokens of an undisturbed run of both waves (computed once)."""
    if not _REFERENCE:
        tokens: dict[str, list[int]] = {}
        async with generate_client(**settings(health={"liveness_interval": None})) as (
                _, undisturbed):
            for wave in (WAVE, LATER):
                for rid, outcome in (await run_wave(undisturbed.front, wave)).items():
                    assert outcome.error is None
                    tokens[rid] = outcome.tokens
        _REFERENCE.update(tokens)
    return _REFERENCE


def engine_up(client: Client) -> dict[str, float]:
    text = generate_latest(client.metrics.registry).decode()
    return {line.split('engine="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith("anyio_genout:engine_up{")}


async def kill_by_cancelling(c: MockCluster) -> None:
    await wait_until(lambda: c.engines[VICTIM].steps >= 3)
    c.scopes[VICTIM].cancel()  # its sockets close, as a killed process's do


async def no_kill(c: MockCluster) -> None:
    return  # the fault is in the victim's MockFaults


#: The fault, how it is caused, the error it gives, and HealthConfig settings.
WAYS: dict[str, tuple[MockFaults | None, Any, str, dict[str, Any]]] = {
    "sentinel": (MockFaults(dead_after_steps=3), no_kill, "ENGINE_CORE_DEAD (engine 2)",
                 {"liveness_interval": None}),
    # The probe alone (the liveness check could find the closed engine first).
    "sockets closed": (None, kill_by_cancelling, "engine 2: its connection to the client's",
                       {"liveness_interval": None}),
    "silent": (MockFaults(silent_after_steps=3), no_kill,
               "engine 2 did not answer a liveness check within 2 s", {"liveness_timeout": 2.0}),
}


@pytest.mark.parametrize("way", list(WAYS))
async def test_one_engine_dies_only_its_requests_fail_and_the_rest_serve(way: str) -> None:
    expected = await reference()
    faults, kill, message, health = WAYS[way]
    async with generate_client(**settings(faults, health=health)) as (_, c):
        client, engine = c.front, c.client
        assert engine_up(client) == {"0": 1.0, "1": 1.0, "2": 1.0, "3": 1.0}
        async with anyio.create_task_group() as tg:
            started = anyio.Event()
            wave: dict[str, Outcome] = {}

            async def streams() -> None:
                wave.update(await run_wave(client, WAVE, started))

            tg.start_soon(streams)
            await started.wait()
            await kill(c)
        assert len(wave) == STREAMS
        failed = {rid: o for rid, o in wave.items() if o.error is not None}
        assert failed, "the victim died with no request in flight"
        for rid, outcome in wave.items():
            if outcome.engine != VICTIM:
                # Every other engine's stream is whole: the tokens of an undisturbed run.
                assert outcome.error is None, (rid, outcome.error)
                assert outcome.tokens == expected[rid], rid
            elif outcome.error is None:
                assert outcome.tokens == expected[rid], rid  # finished before the death
            else:
                error = outcome.error
                assert isinstance(error, EngineDeadError) and error.ranks == (VICTIM,)
                assert message in str(error), str(error)
                assert outcome.tokens == expected[rid][:len(outcome.tokens)], rid
        # The engine left the routing set; the client stays healthy.
        assert engine.is_healthy and engine.health_error is None
        assert engine.live_engines == [0, 1, 3]
        health = engine.engine_health
        assert [rank for rank, why in health.items() if why is None] == [0, 1, 3]
        assert message in str(health[VICTIM])
        assert engine_up(client) == {"0": 1.0, "1": 1.0, "2": 0.0, "3": 1.0}
        assert engine.in_flight == 0
        await wait_until(lambda: engine.pending_utility_calls == 0)  # between liveness pings
        # New requests go to the live engines only, and get their tokens.
        later = await run_wave(client, LATER)
        assert {o.engine for o in later.values()} == {0, 1, 3}
        assert all(o.error is None and o.tokens == expected[rid] for rid, o in later.items())
        # A request pinned to the dead engine fails at once, naming the rank.
        pinned = attrs.evolve(generate_request("pinned"), data_parallel_rank=VICTIM)
        with anyio.fail_after(1), pytest.raises(EngineDeadError) as info:
            async with client.generate(pinned):
                pass
        assert str(info.value).startswith("data_parallel_rank=2: engine 2 is down: ")
        assert message in str(info.value)
        # Utility calls go to the live engines.
        assert await engine.call_utility("is_sleeping") == [False, False, False]
        # No ABORT went to the dead engine for the requests that died with it.
        assert not set(failed) & {rid.rsplit("-", 1)[0] for rid in
                                  c.engines[VICTIM].aborted_ids}


async def test_the_last_engine_death_makes_the_client_unhealthy() -> None:
    async with generate_client(**settings(health={"liveness_interval": None})) as (_, c):
        engine = c.client
        for rank in (0, 1, 3):
            c.scopes[rank].cancel()
        await wait_until(lambda: engine.live_engines == [VICTIM], 5)
        assert engine.is_healthy
        c.scopes[VICTIM].cancel()
        await wait_until(lambda: not engine.is_healthy, 5)
        # Found by the probe or the liveness check, whichever comes first.
        assert isinstance(engine.health_error, EngineDeadError)
        assert engine.health_error.ranks == (VICTIM,)
        assert str(engine.health_error).startswith("engine 2")
        assert engine.live_engines == []
        assert all(isinstance(why, EngineDeadError) for why in engine.engine_health.values())
        assert engine_up(c.front) == {"0": 0.0, "1": 0.0, "2": 0.0, "3": 0.0}


async def test_a_utility_call_reports_the_engine_that_died_while_it_waited() -> None:
    async with generate_client(**settings(MockFaults(silent_after_steps=0),
                                          health={"liveness_interval": 0.3})) as (_, c):
        engine = c.client
        with anyio.fail_after(5), pytest.raises(UtilityCallError) as info:
            await engine.call_utility("is_sleeping")  # engine 2 never answers
        error = info.value
        assert error.results == {0: False, 1: False, 3: False}
        assert list(error.failures) == [VICTIM]
        assert "engine 2 died: engine 2 did not answer a liveness check" in str(error)
        assert engine.is_healthy and engine.live_engines == [0, 1, 3]


async def test_whole_client_policy_fails_everything_and_aborts_on_the_survivors() -> None:
    async with generate_client(**settings(MockFaults(dead_after_steps=3),
                                          health={"engine_failure": "client",
                                                  "liveness_interval": None})) as (_, c):
        wave = await run_wave(c.front, WAVE[:100])
        engine = c.client
        assert not engine.is_healthy
        assert str(engine.health_error).startswith(
            "an engine core sent ENGINE_CORE_DEAD (engine 2)")
        unfinished = {rid for rid, o in wave.items() if o.error is not None}
        assert {o.engine for rid, o in wave.items() if rid in unfinished} >= {0, 1, 3, 2}
        # The requests the death ended on live engines are aborted there, once each; the
        # dead engine is sent nothing.
        with anyio.fail_after(2):
            while True:
                aborted = {e: {rid.rsplit("-", 1)[0] for rid in c.engines[e].aborted_ids}
                           for e in range(ENGINES)}
                if all(aborted[e] for e in (0, 1, 3)):
                    break
                await anyio.sleep(0.01)
        assert not aborted[VICTIM]
        for rank in (0, 1, 3):
            assert aborted[rank] == {rid for rid in unfinished if wave[rid].engine == rank}
