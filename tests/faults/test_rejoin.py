"""Engines that come back (issue #16): a restarted engine of a known rank rejoins.

Mock engines (in this event loop) behind one generate :class:`Client`; one is killed (by
``ENGINE_CORE_DEAD``, or its task cancelled with its sockets closed, as a killed process's
close), and a new :class:`MockEngine` with the same rank dials the same handshake address:
it gets INIT, registers, says READY and rejoins routing (requests pinned to it and routed
reach the new engine; ``live_engines``, ``engine_health``, the health listeners and the
``anyio_genout:engine_up`` gauge say so; its ready response replaces the old one). A HELLO
from a rank that is up, or one outside the client's ranks, is refused (no INIT) with a log
line. Bootstrapped engines rejoin by registering on the input socket again.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import anyio
import anyio.abc
import attrs
import pytest
import zmq
from prometheus_client import generate_latest

from anyio_genout import (
    Client,
    EngineDeadError,
    HandshakeTimeoutError,
    HandshakeTransport,
    HealthConfig,
)
from anyio_genout.mock import MockEngine, MockFaults
from anyio_genout.protocol import EngineStatus, StatusMessage, encode_status
from tests.cluster import MockCluster, generate_client
from tests.faults.support import RawPeer, generate_request
from tests.support import wait_until

pytestmark = pytest.mark.anyio

VICTIM = 1


def settings(engines: int = 3, *, victim: dict[str, Any] | None = None,
             health: dict[str, Any] | None = None, **config: Any) -> dict[str, Any]:
    """:func:`generate_client`'s settings for this suite: ``engines`` mock engines
    (``victim``: engine ``VICTIM``'s overrides), a short disconnect grace and no liveness
    check (``health``: other HealthConfig settings); the rest: :func:`generate_client`'s
    (``bootstrapped``) and EngineCoreClientConfig settings."""
    return {"engines": engines, "mock": {"step_time": 0.002, "linger": 0.0},
            "overrides": {VICTIM: victim} if victim else {}, "model_name": "rejoin",
            "health": HealthConfig(**{"disconnect_grace": 0.5, "liveness_interval": None,
                                      **(health or {})}), **config}


async def stream(client: Client, rid: str, *, rank: int | None = None,
                 max_tokens: int = 8) -> tuple[int, list[int]]:
    """One greedy stream to its end: the engine it ran on and its tokens."""
    request = attrs.evolve(generate_request(rid, max_tokens=max_tokens),
                           data_parallel_rank=rank)
    tokens: list[int] = []
    with anyio.fail_after(5):
        async with client.generate(request) as s:
            async for out in s:
                tokens.extend(out.token_ids)
            return s.engine_index, tokens


async def spread(client: Client, wave: str, count: int) -> dict[str, int]:
    """``count`` concurrent unpinned streams; the engine each ran on."""
    engines: dict[str, int] = {}

    async def one(i: int) -> None:
        rid = f"{wave}-{i}"
        engines[rid], tokens = await stream(client, rid)
        assert len(tokens) == 8

    async with anyio.create_task_group() as tg:
        for i in range(count):
            tg.start_soon(one, i)
    return engines


def gauge(client: Client) -> dict[str, float]:
    """``anyio_genout:engine_up`` as exported, by engine label."""
    text = generate_latest(client.metrics.registry).decode()
    return {line.split('engine="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith("anyio_genout:engine_up{")}


async def check_serves_again(c: MockCluster, new: MockEngine, wave: str) -> None:
    """Requests pinned to the victim and routed ones reach the new engine."""
    client, engine = c.front, c.client
    ranks = engine.engine_ranks
    assert engine.live_engines == ranks
    assert engine.engine_health == dict.fromkeys(ranks)
    assert gauge(client) == {str(rank): 1.0 for rank in ranks}
    ran_on, tokens = await stream(client, f"{wave}-pinned", rank=VICTIM)
    assert ran_on == VICTIM and len(tokens) == 8
    assert any(rid.startswith(f"{wave}-pinned") for rid in new.added_ids)
    routed = await spread(client, wave, 4 * len(ranks))
    assert set(routed.values()) == set(ranks)  # idle engines share the load
    assert {rid for rid, rank in routed.items() if rank == VICTIM} == {
        rid.rsplit("-", 1)[0] for rid in new.added_ids if not rid.startswith(f"{wave}-p")}
    assert await engine.call_utility("is_sleeping") == [False] * len(ranks)
    assert engine.in_flight == 0


@pytest.mark.parametrize("way", ["sentinel", "sockets closed"])
async def test_a_killed_engine_restarted_rejoins_and_serves_again(way: str) -> None:
    async with generate_client(**settings()) as (_, c):
        client, engine = c.front, c.client
        old_ready = engine.ready_responses[VICTIM]
        # A stream on the victim when it dies fails with one error naming it.
        victim_stream = anyio.Event()
        outcome: list[BaseException] = []

        async def long_stream() -> None:
            request = attrs.evolve(generate_request("long", max_tokens=2000),
                                   data_parallel_rank=VICTIM)
            async with client.generate(request) as s:
                try:
                    async for _ in s:
                        victim_stream.set()
                except EngineDeadError as exc:
                    outcome.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(long_stream)
            with anyio.fail_after(5):
                await victim_stream.wait()
            await c.kill(VICTIM, way)
        assert len(outcome) == 1 and outcome[0].ranks == (VICTIM,)  # type: ignore[attr-defined]
        assert engine.live_engines == [0, 2]
        assert gauge(client) == {"0": 1.0, "1": 0.0, "2": 1.0}
        assert c.health == [(VICTIM, False)]

        # A new engine of the same rank dials the same handshake address: it rejoins.
        new = await c.restart(VICTIM, vllm_version="0.33.1")
        assert c.health == [(VICTIM, False), (VICTIM, True)]
        assert engine.is_healthy
        assert engine.ready_responses[VICTIM].vllm_version == "0.33.1"  # the new one's
        assert old_ready.vllm_version != "0.33.1"
        await check_serves_again(c, new, "after")


async def test_a_hello_from_a_rank_that_is_up_is_refused(
        caplog: pytest.LogCaptureFixture) -> None:
    async with generate_client(**settings(2)) as (_, c):
        duplicate = c.new_engine(0, handshake_timeout=0.3)
        with (caplog.at_level(logging.WARNING, "anyio_genout.engine"), anyio.fail_after(5),
              pytest.raises(HandshakeTimeoutError)):
            await duplicate.serve()  # no INIT comes
        assert "engine 0 said HELLO while it is up" in caplog.text
        assert not duplicate.ready
        # The engine that is up serves on, and nothing changed.
        assert c.client.live_engines == [0, 1] and c.health == []
        assert (await stream(c.front, "still", rank=0))[0] == 0
        assert any(rid.startswith("still") for rid in c.engines[0].added_ids)


@pytest.mark.parametrize("bootstrapped", [False, True])
async def test_an_engine_restarted_before_its_death_was_found_rejoins(
        bootstrapped: bool) -> None:
    # A supervisor restarts a killed engine at once: its HELLO (bootstrapped: its
    # registration) comes while the client still has the rank up, in the disconnect
    # grace. Refused then, it was never answered and the rank stayed down for good.
    grace = 1.0
    async with generate_client(**settings(bootstrapped=bootstrapped,
                                          health={"disconnect_grace": grace})) as (_, c):
        engine = c.client
        c.scopes[VICTIM].cancel()  # its sockets close, as a killed process's do
        new = await c.start(VICTIM, vllm_version="0.33.1")
        await anyio.sleep(0.3)  # its HELLO (registration) is in by now
        assert VICTIM in engine.live_engines  # the death is not found yet: the grace
        await wait_until(lambda: engine.ready_responses[VICTIM].vllm_version == "0.33.1",
                         grace + 5)
        assert c.health == [(VICTIM, False), (VICTIM, True)]
        await check_serves_again(c, new, "after")


async def test_a_rank_out_of_range_is_refused_and_junk_ignored(
        caplog: pytest.LogCaptureFixture) -> None:
    async with generate_client(**settings(2)) as (_, c):
        transport = c.client.config.transport
        assert isinstance(transport, HandshakeTransport)
        address = transport.address
        with caplog.at_level(logging.WARNING, "anyio_genout.engine"):
            # Junk on the handshake socket after start-up, also under an engine's identity.
            for identity, junk in ((b"stray", [b"\xc1"]), (b"\x00\x00", [b"\xc1"]),
                                   (b"\x01\x00", [b"a", b"b"])):
                line = f"ignoring a message on the handshake socket from {identity!r}"
                peer = RawPeer(zmq.DEALER, identity=identity).connect(address)
                try:
                    await peer.send(junk)
                    # Left open until the client has read (and logged) it: closed at once
                    # (linger 0), a message ZeroMQ has not moved yet would be dropped.
                    await wait_until(lambda line=line: line in caplog.text)
                finally:
                    peer.close()
            stranger = c.new_engine(5, handshake_timeout=0.3)
            with anyio.fail_after(5), pytest.raises(HandshakeTimeoutError):
                await stranger.serve()
        assert ("refusing a HELLO from an engine with identity b'\\x05\\x00': its rank is "
                "not one of this client's (ranks 0..1; elastic growth is not supported)"
                in caplog.text)
        assert "ignoring a message on the handshake socket from b'stray'" in caplog.text
        assert c.client.is_healthy and c.client.live_engines == [0, 1]
        # A READY from an engine that sent no HELLO is junk too.
        peer = RawPeer(zmq.DEALER, identity=b"\x00\x00").connect(address)
        try:
            await peer.send([encode_status(StatusMessage(EngineStatus.READY, local=False,
                                                         headless=True))])
            await wait_until(lambda: "READY without a HELLO" in caplog.text)
        finally:
            peer.close()
        # Rejoining still works after all that.
        await c.kill(VICTIM, "sockets closed")
        new = await c.restart(VICTIM)
        assert (await stream(c.front, "back", rank=VICTIM))[0] == VICTIM
        assert any(rid.startswith("back") for rid in new.added_ids)


async def test_a_hung_engine_restarted_takes_over_its_identity_and_rejoins() -> None:
    # The hung engine's process lives on with its connections open (found by the liveness
    # check): the new engine takes its identity over (ROUTER_HANDOVER) on both sockets.
    async with generate_client(**settings(victim={"faults": MockFaults(silent_after_steps=0)},
                                          health={"liveness_interval": 0.2,
                                                  "liveness_timeout": 2.0})) as (_, c):
        hung = c.engines[VICTIM]
        await wait_until(lambda: VICTIM not in c.client.live_engines, 10)
        assert "did not answer a liveness check" in str(c.client.engine_health[VICTIM])
        new = await c.restart(VICTIM)
        await check_serves_again(c, new, "hung")
        assert not hung.added_ids  # nothing went to the old process


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_restarting_an_engine_again_and_again_leaks_nothing() -> None:
    async with generate_client(**settings()) as (_, c):
        fds: list[int] = []
        ways = ["sockets closed", "sentinel", "sockets closed", "sentinel"]
        for n, way in enumerate(ways):
            await c.kill(VICTIM, way)
            new = await c.restart(VICTIM)
            await check_serves_again(c, new, f"round{n}")
            await wait_until(lambda: c.client.pending_utility_calls == 0)
            await anyio.sleep(0.1)  # the old engine's context is terminated by now
            fds.append(_open_fds())
        assert c.health == [(VICTIM, False), (VICTIM, True)] * len(ways)
        assert c.client.in_flight == 0 and c.client.is_healthy
        # Steady state: the later restarts hold no more descriptors than the second. (The
        # first may open what a process opens once: the first test in an xdist worker saw
        # [75, 82, 82].)
        assert fds[3] <= fds[1], fds


async def test_a_bootstrapped_engine_that_registers_again_rejoins() -> None:
    async with generate_client(**settings(bootstrapped=True)) as (_, c):
        await c.kill(VICTIM, "sockets closed")
        assert c.client.live_engines == [0, 2]
        assert gauge(c.front)["1"] == 0.0
        new = await c.restart(VICTIM, vllm_version="0.33.1")
        assert c.client.ready_responses[VICTIM].vllm_version == "0.33.1"
        assert c.health == [(VICTIM, False), (VICTIM, True)]
        await check_serves_again(c, new, "boot")


async def test_an_engine_of_an_unsupported_version_is_refused_and_stays_down(
        caplog: pytest.LogCaptureFixture) -> None:
    async with generate_client(**settings(2)) as (_, c):
        await c.kill(VICTIM, "sockets closed")
        with caplog.at_level(logging.ERROR, "anyio_genout.engine"):
            await c.start(VICTIM, vllm_version="0.99.0")
            await wait_until(lambda: "engine 1 came back but is refused" in caplog.text)
        assert "0.99.0" in caplog.text
        assert c.client.live_engines == [0]
        with pytest.raises(EngineDeadError, match="engine 1 is down"):
            await stream(c.front, "nope", rank=VICTIM)
        # A supported restart after it rejoins.
        c.scopes[VICTIM].cancel()
        await c.restart(VICTIM)
        assert (await stream(c.front, "yes", rank=VICTIM))[0] == VICTIM
