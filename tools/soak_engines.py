"""``tools/soak.py --kill-engines``: engines killed and restarted at random under load.

One generate :class:`~anyio_genout.Client` (per-engine failure, request migration on) over
``--engines`` in-process mock engines. Request loops send greedy streams of random lengths
back to back and leave a share of them early. A killer, every 0.3-1.5 s, kills a random
engine that is up (``ENGINE_CORE_DEAD``, or its task cancelled so its sockets close, as a
killed process's do), waits until the client has it down, and after 0.1-1 s starts a new
engine of the same rank on the same handshake address, which must rejoin within 5 s.

At the end it checks: nothing lost (every request sent ended exactly once: its terminal
output with every token it asked for, one error, or its caller leaving), registries empty,
the migrations the streams report equal to ``anyio_genout:request_migrations_total``,
every engine up again, and RSS bounded; exits 1 on any problem.
"""

from __future__ import annotations

import argparse
import collections
import functools
import gc
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio
import anyio.abc

from anyio_genout import (
    Client,
    ClientConfig,
    EngineCoreClient,
    EngineCoreClientConfig,
    GenerateRequest,
    GenoutError,
    HandshakeTransport,
    HealthConfig,
    SamplingParams,
)
from anyio_genout.mock import MockEngine, MockEngineConfig
from anyio_genout.transport import free_tcp_port

MiB = 2**20
#: Seconds a restarted engine has to rejoin, and a killed one to be found down.
REJOIN_TIMEOUT = 5.0


@dataclass
class Totals:
    sent: int = 0
    outcomes: collections.Counter[str] = field(default_factory=collections.Counter)
    errors: collections.Counter[str] = field(default_factory=collections.Counter)
    kills: collections.Counter[str] = field(default_factory=collections.Counter)
    restarts: int = 0
    migrated_requests: int = 0
    migrations: int = 0
    tokens: int = 0
    problems: list[str] = field(default_factory=list)

    def problem(self, text: str) -> None:
        if len(self.problems) < 50:
            self.problems.append(text)


class Engines:
    """The mock engines by rank (the latest of each), each in a cancel scope of its own."""

    def __init__(self, tg: anyio.abc.TaskGroup, handshake: str, step_time: float) -> None:
        self.tg = tg
        self.handshake = handshake
        self.step_time = step_time
        self.engines: dict[int, MockEngine] = {}
        self.scopes: dict[int, anyio.CancelScope] = {}

    def start(self, rank: int) -> None:
        engine = self.engines[rank] = MockEngine(MockEngineConfig(
            rank=rank, handshake_address=self.handshake, step_time=self.step_time,
            linger=0.0, keep_history=False))
        scope = self.scopes[rank] = anyio.CancelScope()

        async def serve() -> None:
            with scope:
                await engine.serve()

        self.tg.start_soon(serve)


async def _until(predicate: Callable[[], bool], seconds: float, what: str,
                 totals: Totals) -> bool:
    with anyio.move_on_after(seconds):
        while not predicate():  # noqa: ASYNC110 - polling the client's state
            await anyio.sleep(0.01)
        return True
    totals.problem(f"{what} not within {seconds:g} s")
    return False


def _is_up(client: EngineCoreClient, rank: int) -> bool:
    return rank in client.live_engines


def _is_down(client: EngineCoreClient, rank: int) -> bool:
    return rank not in client.live_engines


async def killer(engines: Engines, client: EngineCoreClient, rng: random.Random,
                 totals: Totals, deadline: float) -> None:
    while time.monotonic() < deadline - 2.0:
        await anyio.sleep(rng.uniform(0.3, 1.5))
        live = client.live_engines
        if len(live) < 2:  # keep one up: with none, requests fail (that is tested elsewhere)
            continue
        rank = rng.choice(live)
        way = rng.choice(["sentinel", "sockets closed"])
        totals.kills[way] += 1
        if way == "sentinel":
            engines.engines[rank].die("killed by the soak")
        engines.scopes[rank].cancel()  # its sockets close, as a killed process's do
        if not await _until(functools.partial(_is_down, client, rank), REJOIN_TIMEOUT,
                            f"engine {rank} found down after a kill ({way})", totals):
            return
        await anyio.sleep(rng.uniform(0.1, 1.0))
        engines.start(rank)
        totals.restarts += 1
        if not await _until(functools.partial(_is_up, client, rank), REJOIN_TIMEOUT,
                            f"engine {rank} rejoined after a restart", totals):
            return


async def one(client: Client, rid: str, rng: random.Random, totals: Totals) -> None:
    wanted = rng.randint(4, 96)
    request = GenerateRequest(
        request_id=rid, prompt_token_ids=[rng.randrange(1, 30000) for _ in range(8)],
        sampling_params=SamplingParams(max_tokens=wanted, ignore_eos=True, temperature=0.0))
    leave_after = rng.randint(1, wanted) if rng.random() < 0.1 else None
    totals.sent += 1
    got = 0
    finished = False
    stream = client.generate(request)
    try:
        async with stream:
            async for out in stream:
                got += len(out.token_ids)
                if out.finished:
                    finished = True
                if leave_after is not None and got >= leave_after and not finished:
                    break
    except GenoutError as exc:
        totals.outcomes["error"] += 1
        totals.errors[type(exc).__name__] += 1
        return
    finally:
        if stream.migrations:
            totals.migrated_requests += 1
            totals.migrations += stream.migrations
    totals.tokens += got
    if finished:
        totals.outcomes["finished"] += 1
        if got != wanted:
            totals.problem(f"{rid}: {got} tokens, asked for {wanted} (migrations: "
                           f"{stream.migrations})")
    elif leave_after is not None:
        totals.outcomes["left"] += 1
    else:
        totals.problem(f"{rid}: the stream ended without its terminal output or an error")


async def kill_engines_soak(args: argparse.Namespace, say: Callable[[str], None],
                            rss: Callable[[], int]) -> list[str]:
    """Run the soak; returns the problems found (none: zero lost, zero leaks)."""
    rng = random.Random(args.seed)
    totals = Totals()
    handshake = f"tcp://127.0.0.1:{free_tcp_port()}"
    engine_config = EngineCoreClientConfig(
        transport=HandshakeTransport(handshake), engine_count=args.engines, ready_timeout=10.0,
        health=HealthConfig(disconnect_grace=0.5, liveness_interval=None))
    gc.collect()
    start_rss = rss()
    started = time.monotonic()
    deadline = started + args.duration
    async with anyio.create_task_group() as tg:
        engines = Engines(tg, handshake, step_time=0.002)
        for rank in range(args.engines):
            engines.start(rank)
        async with Client.connect(ClientConfig(engine=engine_config, registry=None,
                                               migration_limit=args.migration_limit)) as client:
            counter = 0

            async def worker() -> None:
                nonlocal counter
                while time.monotonic() < deadline:
                    counter += 1
                    with anyio.fail_after(30):  # nothing may hang
                        await one(client, f"soak-{counter}", rng, totals)

            async with anyio.create_task_group() as work:
                work.start_soon(killer, engines, client.engine, rng, totals, deadline)
                for _ in range(args.workers):
                    work.start_soon(worker)
            await _until(lambda: len(client.engine.live_engines) == args.engines,
                         REJOIN_TIMEOUT, "every engine up at the end", totals)
            left = (client.engine.in_flight, client.inflight)
            if any(left):
                totals.problem(f"registries not empty at the end (in_flight, inflight) = "
                               f"{left}")
            counted = sum(client.metrics.migrations.values())
            if counted != totals.migrations:
                totals.problem(f"the streams report {totals.migrations} migrations, the "
                               f"metric counts {counted}")
        tg.cancel_scope.cancel()
    elapsed = time.monotonic() - started
    gc.collect()
    end_rss = rss()
    ended = sum(totals.outcomes.values())
    if ended != totals.sent:
        totals.problem(f"{totals.sent} requests sent, {ended} ended")
    if end_rss - start_rss > 128 * MiB:
        totals.problem(f"RSS grew by {(end_rss - start_rss) / MiB:.1f} MiB")
    if not totals.outcomes["finished"]:
        totals.problem("no request finished")
    say(f"soak --kill-engines: backend {args.backend}, {elapsed:.1f} s, {args.engines} mock "
        f"engines, {args.workers} request loops, migration_limit {args.migration_limit}, "
        f"seed {args.seed}")
    say(f"kills: {sum(totals.kills.values())} ({dict(totals.kills)}), restarts (each "
        f"rejoined): {totals.restarts}")
    say(f"requests: {totals.sent} sent, {totals.outcomes['finished']} finished with every "
        f"token ({totals.outcomes['finished'] / elapsed:.0f}/s), {totals.outcomes['left']} "
        f"left early by their callers, {totals.outcomes['error']} ended with one error "
        f"{dict(totals.errors) or ''}; {totals.tokens} tokens")
    say(f"migrations: {totals.migrations} of {totals.migrated_requests} requests "
        f"(anyio_genout:request_migrations_total agrees)")
    say(f"RSS: start {start_rss / MiB:.1f} MiB, end {end_rss / MiB:.1f} MiB")
    return totals.problems
