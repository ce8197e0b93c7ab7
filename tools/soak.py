#!/usr/bin/env python3
"""A bounded soak of the client against mock engines with random faults and cancellations.

``python tools/soak.py --duration 60 --backend trio`` (or ``nox -s soak -- --backend trio``).

Several *slots* run side by side in one process and one event loop. Each slot runs
*generations* back to back: a fresh generate :class:`~anyio_genout.Client` over fresh
in-process mock engines (two by default), each engine with random faults drawn from
:class:`~anyio_genout.mock.MockFaults`:

* ``dead_after_steps``: ENGINE_CORE_DEAD mid-stream;
* ``garbage_after_steps``: an undecodable message on the output socket;
* ``silent_after_steps``: the engine stops reading and stepping (no sentinel); the client's
  liveness check (on here) must find it;
* ``late_outputs_after_abort``, ``preempt_every``: outputs after an abort, preemptions.

A fault ends the generation (the client becomes unhealthy); otherwise it ends after a random
lifetime. Meanwhile workers send requests with random lengths and leave a random share of
them early (a timeout, ``break``, ``stream.cancel()``, an exception). At the end of every
generation the soak checks:

* nothing lost: every request that was sent ended with its terminal output, exactly one
  error (then StopAsyncIteration), or its caller's own cancellation;
* registries empty: ``client.engine.in_flight``, ``client.inflight`` and pending utility
  calls are all zero;
* aborts: no id aborted twice; on a healthy generation the ids the engines received are
  exactly the requests left before their terminal output reached the client, and
  ``aborts_sent`` equals their number; on a failed one, received ⊆ expected;
* metrics: ``vllm:request_success_total`` summed over reasons equals the requests that did
  not end with an error.

It prints requests completed, errors by kind, aborts sent versus expected, registry sizes
and RSS at start, after warm-up and at the end, and exits 1 on any leak or mismatch.
Everything binds on 127.0.0.1 with ephemeral ports.
"""

from __future__ import annotations

import argparse
import collections
import gc
import logging
import os
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import anyio
import anyio.lowlevel
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from anyio_genout import (
    Client,
    ClientConfig,
    EngineCoreClientConfig,
    GenerateRequest,
    GenoutError,
    HandshakeTransport,
    HealthConfig,
    SamplingParams,
)
from anyio_genout.mock import MockEngine, MockEngineConfig, MockFaults
from anyio_genout.transport import free_tcp_port

MiB = 2**20


def rss() -> int:
    """Resident set size of this process in bytes (Linux /proc; psutil elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # pragma: no cover - not Linux
        import psutil

        return int(psutil.Process().memory_info().rss)


def free_port() -> int:
    return free_tcp_port()


@dataclass
class Totals:
    generations: int = 0
    generations_failed: collections.Counter[str] = field(default_factory=collections.Counter)
    faults: collections.Counter[str] = field(default_factory=collections.Counter)
    sent: int = 0
    outcomes: collections.Counter[str] = field(default_factory=collections.Counter)
    errors: collections.Counter[str] = field(default_factory=collections.Counter)
    tokens: int = 0
    aborts_expected: int = 0
    aborts_sent: int = 0
    aborts_received: int = 0
    metric_requests: float = 0.0
    max_in_flight_left: int = 0
    max_inflight_left: int = 0
    max_pending_utility_left: int = 0
    problems: list[str] = field(default_factory=list)

    def problem(self, text: str) -> None:
        if len(self.problems) < 50:
            self.problems.append(text)
        elif len(self.problems) == 50:
            self.problems.append("... more problems not shown")


def success_total(client: Client) -> float:
    text = generate_latest(client.metrics.registry).decode()
    return sum(sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples if sample.name == "vllm:request_success_total")


def random_faults(rng: random.Random, totals: Totals) -> MockFaults:
    kind = rng.choices(["none", "dead", "garbage", "silent"], weights=[55, 25, 10, 10])[0]
    steps = rng.randint(20, 2000)
    totals.faults[kind] += 1
    return MockFaults(
        dead_after_steps=steps if kind == "dead" else None,
        garbage_after_steps=steps if kind == "garbage" else None,
        silent_after_steps=steps if kind == "silent" else None,
        late_outputs_after_abort=rng.choice([0, 0, 1, 2]),
        preempt_every=rng.choice([None, None, 3, 7, 25]),
    )


class Generation:
    """One client over fresh mock engines, its workers and its end-of-life checks."""

    def __init__(self, slot: int, number: int, rng: random.Random, totals: Totals,
                 args: argparse.Namespace, deadline: float) -> None:
        self.name = f"slot{slot}-gen{number}"
        self.rng = rng
        self.totals = totals
        self.args = args
        self.deadline = deadline
        self.expect_abort: set[str] = set()
        self.outcomes: dict[str, str] = {}
        self.sent = 0
        self.stop = anyio.Event()

    async def run(self) -> None:
        args, rng = self.args, self.rng
        address = f"tcp://127.0.0.1:{free_port()}"
        engines = [
            MockEngine(MockEngineConfig(
                handshake_address=address, rank=rank, max_num_seqs=rng.choice([64, 256]),
                step_time=rng.choice([0.0, 0.0, 0.001, 0.003]), linger=0.5,
                seed=rng.randrange(2**32), faults=random_faults(rng, self.totals)))
            for rank in range(args.engines)
        ]
        config = ClientConfig(
            engine=EngineCoreClientConfig(
                transport=HandshakeTransport(address), engine_count=args.engines,
                ready_timeout=10,
                health=HealthConfig(liveness_interval=0.25, liveness_timeout=1.0)),
            model_name=self.name)
        lifetime = rng.uniform(2.0, 10.0)
        async with anyio.create_task_group() as engines_tg:
            for engine in engines:
                engines_tg.start_soon(engine.serve)
            async with Client.connect(config) as client:
                self.client = client
                async with anyio.create_task_group() as tg:
                    for w in range(args.workers):
                        tg.start_soon(self.worker, w)
                    with anyio.move_on_after(min(lifetime, self.deadline - time.monotonic())):
                        while client.engine.is_healthy:  # noqa: ASYNC110 - polled state
                            await anyio.sleep(0.05)
                    self.stop.set()
                await self.check(client, engines)
                client.metrics.unregister()
            engines_tg.cancel_scope.cancel()

    async def worker(self, w: int) -> None:
        client, rng = self.client, self.rng
        i = 0
        while not self.stop.is_set() and client.engine.is_healthy:
            i += 1
            await self.one(client, f"{self.name}-w{w}-{i}", rng)

    async def one(self, client: Client, rid: str, rng: random.Random) -> None:
        how = rng.choices(["keep", "time", "count", "cancel", "raise"],
                          weights=[70, 10, 10, 5, 5])[0]
        after = rng.randint(0, 40)
        request = GenerateRequest(
            request_id=rid, prompt_token_ids=[rng.randrange(1, 30000)
                                              for _ in range(rng.randint(1, 16))],
            sampling_params=SamplingParams(temperature=rng.choice([0.0, 1.0]),
                                           max_tokens=rng.randint(1, 64)))
        internal: str | None = None
        outcome = "cancelled"
        engine = client.engine
        with anyio.move_on_after(rng.uniform(0.001, 0.2) if how == "time" else 60) as scope:
            try:
                async with client.generate(request) as stream:
                    internal = stream.request_id
                    self.sent += 1
                    seen = 0
                    try:
                        async for out in stream:
                            seen += 1
                            self.totals.tokens += len(out.token_ids)
                            if out.finish_reason is not None:
                                outcome = f"finished:{out.finish_reason.as_str()}"
                            elif seen >= after and how == "count":
                                break
                            elif seen >= after and how == "cancel":
                                # cancel() aborts at once: decide the expectation first.
                                if internal in engine._registry.requests:
                                    self.expect_abort.add(internal)
                                stream.cancel()
                                await anyio.lowlevel.checkpoint()
                            elif seen >= after and how == "raise":
                                raise LookupError("the caller gave up")
                    except GenoutError as exc:
                        outcome = f"error:{type(exc).__name__}"
                        try:  # exactly one error, then the end
                            await stream.__anext__()
                            self.totals.problem(f"{internal}: yielded after its error")
                        except StopAsyncIteration:
                            pass
                        except Exception as again:
                            self.totals.problem(f"{internal}: a second error {again!r}")
                    finally:
                        if internal in engine._registry.requests:  # left before the terminal
                            self.expect_abort.add(internal)
            except LookupError:
                pass
            except GenoutError as exc:  # refused at entry: the client is unhealthy
                outcome = f"refused:{type(exc).__name__}"
        if scope.cancelled_caught and how != "time":
            self.totals.problem(f"{rid}: hung for 60 s")
        if internal is None:
            self.totals.outcomes[outcome] += 1
            return
        if internal in self.outcomes:
            self.totals.problem(f"{internal}: ended twice")
        self.outcomes[internal] = outcome

    async def check(self, client: Client, engines: list[MockEngine]) -> None:
        totals, engine = self.totals, client.engine
        # A liveness ping may be in flight right now: answered within milliseconds by a live
        # engine, or failed by its deadline (liveness_timeout) if the engine went silent.
        with anyio.move_on_after(engine.config.health.liveness_timeout + 1):
            while engine.pending_utility_calls:  # noqa: ASYNC110 - polled state
                await anyio.sleep(0.005)
        healthy = engine.is_healthy
        if healthy:  # let the abort worker send, and the live engines read, the last ABORTs
            with anyio.move_on_after(5):
                while engine.aborts_sent < len(self.expect_abort) or sum(  # noqa: ASYNC110
                        len(e.aborted_ids) for e in engines) < engine.aborts_sent:
                    await anyio.sleep(0.01)
        totals.generations += 1
        if not healthy:
            error = engine.health_error
            kind = type(error).__name__
            if "liveness" in str(error):
                kind += " (liveness check)"
            elif "ENGINE_CORE_DEAD" in str(error):
                kind += " (ENGINE_CORE_DEAD)"
            totals.generations_failed[kind] += 1
        totals.sent += self.sent
        for outcome in self.outcomes.values():
            totals.outcomes[outcome.split(":")[0]] += 1
            if outcome.startswith("error:"):
                totals.errors[outcome[6:]] += 1
        if len(self.outcomes) != self.sent:
            totals.problem(f"{self.name}: {self.sent} sent, {len(self.outcomes)} ended")
        received = [rid for e in engines for rid in e.aborted_ids]
        totals.aborts_expected += len(self.expect_abort)
        totals.aborts_sent += engine.aborts_sent
        totals.aborts_received += len(received)
        if len(received) != len(set(received)):
            totals.problem(f"{self.name}: an id was aborted twice")
        if healthy:
            if set(received) != self.expect_abort:
                totals.problem(f"{self.name}: aborts received {len(set(received))} != "
                               f"expected {len(self.expect_abort)}")
            if engine.aborts_sent != len(self.expect_abort):
                totals.problem(f"{self.name}: aborts sent {engine.aborts_sent} != "
                               f"expected {len(self.expect_abort)}")
        else:
            if not set(received) <= self.expect_abort:
                totals.problem(f"{self.name}: unexpected ids aborted")
            if engine.aborts_sent > len(self.expect_abort):
                totals.problem(f"{self.name}: more aborts sent than expected")
        for rid, outcome in self.outcomes.items():
            if not outcome.startswith("error:") and outcome != "cancelled" \
                    and not outcome.startswith("finished:"):
                totals.problem(f"{rid}: odd outcome {outcome}")
        counted = success_total(client)
        not_errors = sum(1 for o in self.outcomes.values() if not o.startswith("error:"))
        totals.metric_requests += counted
        if counted != not_errors:
            totals.problem(f"{self.name}: request_success_total {counted} != {not_errors} "
                           f"requests that did not fail")
        sizes = (engine.in_flight, len(client.inflight), engine.pending_utility_calls)
        totals.max_in_flight_left = max(totals.max_in_flight_left, sizes[0])
        totals.max_inflight_left = max(totals.max_inflight_left, sizes[1])
        totals.max_pending_utility_left = max(totals.max_pending_utility_left, sizes[2])
        if any(sizes):
            totals.problem(f"{self.name}: registries not empty (in_flight, inflight, "
                           f"pending utility) = {sizes}")


async def slot(index: int, seed: int, totals: Totals, args: argparse.Namespace,
               deadline: float) -> None:
    rng = random.Random(seed * 1000 + index)
    number = 0
    while time.monotonic() < deadline - 1.0:
        number += 1
        await Generation(index, number, rng, totals, args, deadline).run()


async def soak(args: argparse.Namespace, say: Callable[[str], None]) -> Totals:
    totals = Totals()
    gc.collect()
    start_rss = rss()
    started = time.monotonic()
    deadline = started + args.duration
    warm_rss: list[int] = []

    async def sample_warm() -> None:
        await anyio.sleep(min(10.0, args.duration / 4))
        gc.collect()
        warm_rss.append(rss())

    async with anyio.create_task_group() as tg:
        tg.start_soon(sample_warm)
        async with anyio.create_task_group() as slots:
            for i in range(args.slots):
                slots.start_soon(slot, i, args.seed, totals, args, deadline)
        tg.cancel_scope.cancel()
    elapsed = time.monotonic() - started
    gc.collect()
    end_rss = rss()
    warm = warm_rss[0] if warm_rss else start_rss
    completed = totals.outcomes["finished"]
    say(f"soak: backend {args.backend}, {elapsed:.1f} s, {args.slots} slots x "
        f"{args.engines} mock engines, {args.workers} workers per generation, seed {args.seed}")
    say(f"generations: {totals.generations} ({sum(totals.generations_failed.values())} ended "
        f"by a fault: {dict(totals.generations_failed)}); engine faults drawn: "
        f"{dict(totals.faults)}")
    say(f"requests: {totals.sent} sent, {completed} completed ({completed / elapsed:.0f}/s), "
        f"{totals.outcomes['cancelled']} cancelled by their callers, "
        f"{totals.outcomes['error']} ended with one error, "
        f"{totals.outcomes['refused']} refused at entry; {totals.tokens} tokens")
    say(f"errors by kind: {dict(totals.errors) or 'none'}")
    say(f"aborts: expected {totals.aborts_expected}, sent {totals.aborts_sent}, received by "
        f"the engines {totals.aborts_received}")
    say(f"vllm:request_success_total: {totals.metric_requests:.0f} "
        f"(= requests not ended by an error)")
    say(f"registries left at generation ends (max): in_flight {totals.max_in_flight_left}, "
        f"inflight {totals.max_inflight_left}, pending utility calls "
        f"{totals.max_pending_utility_left}")
    say(f"RSS: start {start_rss / MiB:.1f} MiB, after warm-up {warm / MiB:.1f} MiB, "
        f"end {end_rss / MiB:.1f} MiB")
    growth = end_rss - warm
    if growth > max(64 * MiB, warm // 2):
        totals.problem(f"RSS grew by {growth / MiB:.1f} MiB after warm-up")
    if completed == 0:
        totals.problem("no request completed")
    return totals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--duration", type=float, default=60.0, help="seconds (default 60)")
    parser.add_argument("--backend", choices=["asyncio", "uvloop", "trio"], default="asyncio")
    parser.add_argument("--slots", type=int, default=3, help="clients side by side")
    parser.add_argument("--engines", type=int, default=None,
                        help="mock engines per client (default 2; 4 with --kill-engines)")
    parser.add_argument("--workers", type=int, default=48, help="request loops per client")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--kill-engines", action="store_true",
                        help="instead: one client over --engines engines (4 if not given) "
                             "killed and restarted at random under load, request migration "
                             "on (tools/soak_engines.py)")
    parser.add_argument("--migration-limit", type=int, default=3,
                        help="with --kill-engines: migrations per request (default 3)")
    parser.add_argument("--verbose", action="store_true",
                        help="show the client's and the engines' log (faults log errors)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.verbose else logging.CRITICAL,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    backend, options = args.backend, {}
    if backend == "uvloop":
        backend, options = "asyncio", {"use_uvloop": True}

    def say(line: str) -> None:
        print(line, flush=True)

    if args.kill_engines:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from soak_engines import kill_engines_soak

        args.engines = args.engines or 4
        problems = anyio.run(kill_engines_soak, args, say, rss, backend=backend,
                             backend_options=options)
        if problems:
            print(f"FAILED: {len(problems)} problem(s):")
            for problem in problems:
                print(f"  {problem}")
            return 1
        print("OK: zero lost requests, zero leaks")
        return 0
    args.engines = args.engines or 2
    totals = anyio.run(soak, args, say, backend=backend, backend_options=options)
    if totals.problems:
        print(f"FAILED: {len(totals.problems)} leak(s) or mismatch(es):")
        for problem in totals.problems:
            print(f"  {problem}")
        return 1
    print("OK: zero leaks, zero mismatches")
    return 0


if __name__ == "__main__":
    sys.exit(main())
