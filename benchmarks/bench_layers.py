"""Where the client's CPU per token goes, layer by layer (an ablation ladder).

Run: ``.venv/bin/python benchmarks/bench_layers.py [--concurrency 256] [--tokens 128]
[--backend asyncio|uvloop|trio] [--min-time 2] [--calls]``.

Every rung streams the same workload (C concurrent requests of T tokens, the mock engine in
its own process and paused until a round's requests are all in, as ``anyio-genout bench``
does, GC frozen after warm-up) and reports client CPU per delivered token; each
rung adds one layer to the one before, so the differences are what each layer costs:

1. ``floor``: blocking pyzmq ``recv_multipart`` + ``msgpack.unpackb``, count tokens by id;
2. ``decode``: the same loop with ``decode_outputs`` (the typed protocol decode) instead;
3. ``engine``: :class:`~anyio_genout.EngineCoreClient` streams (``engine.call``) on the
   backend: the reader task, the registry, one output mailbox per request, the event loop;
4. ``generate``: :class:`~anyio_genout.Client` streams (``client.generate``): request
   building, the cancel scope, metrics tracking and ``GenerateOutput`` per output.

``--calls`` also runs one round of the ``generate`` rung under cProfile and prints the Python
function calls per delivered token and the functions with the most own time (cProfile's
overhead inflates small functions; use the counts, not its timings, as figures).

This is a script, not a test: timings depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from anyio_genout import (
    Client,
    ClientConfig,
    EngineCoreClient,
    EngineCoreClientConfig,
    EngineCoreRequest,
    HandshakeTransport,
    SamplingParams,
)
from anyio_genout.bench.floor import FloorClient
from anyio_genout.bench.floor import run_streams as run_floor_streams
from anyio_genout.bench.measure import EngineProcess, Meter, free_port, freeze_gc
from anyio_genout.bench.ours import prompt, run_streams
from anyio_genout.bench.spec import CellSpec, summarise
from anyio_genout.protocol import RequestBatch, decode_outputs

RUNGS = ("floor", "decode", "engine", "generate")


def _spec(args: argparse.Namespace, rung: str) -> CellSpec:
    return CellSpec(impl=rung, backend=args.backend, workload="throughput",
                    concurrency=args.concurrency, tokens=args.tokens, min_rounds=2,
                    min_time=args.min_time)


# ------------------------------------------------------------------ synchronous rungs


def _sync_rung(args: argparse.Namespace, rung: str) -> dict[str, Any]:
    spec = _spec(args, rung)
    context: zmq.Context[Any] = zmq.Context(io_threads=1)
    client = FloorClient(context)
    ids = prompt(spec.prompt_len)
    recv = client.output.recv_multipart

    def round_(tag: str, count: int, tokens: int, gate: bool = False) -> int:
        if rung == "floor":  # exactly what `anyio-genout bench` measures as the floor
            return run_floor_streams(client, count, tokens, ids, tag, release=gate)
        wire = client.template(tokens, ids)
        for i in range(count):
            client.add(wire, f"{tag}-{i}")
        if gate:
            client.utility("resume_scheduler")
        counts: dict[str, int] = {}
        done = 0
        while done < count:
            message = decode_outputs(recv(copy=False))
            if type(message) is not RequestBatch:
                continue  # a utility reply
            for out in message.message.outputs:
                counts[out.request_id] = (counts.get(out.request_id, 0)
                                          + len(out.new_token_ids))
                if out.finish_reason is not None:
                    done += 1
        return sum(counts.values())

    try:
        with EngineProcess(client.handshake_address, spec) as engine:
            client.connect()
            round_("warm", 64, 8)
            freeze_gc()
            meter = Meter(spec, engine)
            n = 0
            while meter.more():
                client.pause()
                started = meter.start()
                tokens = round_(f"r{n}", spec.concurrency, spec.tokens, gate=True)
                meter.stop(started, tokens=tokens)
                n += 1
    finally:
        client.close()
        context.term()
    return summarise(spec, meter.samples, meter.window())


# ------------------------------------------------------------------ async rungs


async def _engine_round(engine: EngineCoreClient, tag: str, count: int, tokens: int,
                        ids: tuple[int, ...], gate: bool = False) -> int:
    delivered = entered = 0
    all_in = anyio.Event()
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0)

    async def one(i: int) -> None:
        nonlocal delivered, entered
        request = EngineCoreRequest(request_id=f"{tag}-{i}", prompt_token_ids=ids,
                                    sampling_params=params, arrival_time=time.time())
        n = 0
        async with engine.call(request) as stream:
            entered += 1
            if entered == count:
                all_in.set()
            async for item in stream:
                n += len(item.output.new_token_ids)
        delivered += n

    async with anyio.create_task_group() as tg:
        for i in range(count):
            tg.start_soon(one, i)
        if gate:
            await all_in.wait()
            await engine.resume_scheduler()
    return delivered


async def _generate_round(client: Client, tag: str, count: int, tokens: int,
                          ids: tuple[int, ...], gate: bool = False) -> int:
    # Exactly what `anyio-genout bench` measures for the throughput workload.
    return await run_streams(client, count, tokens, ids, tag, release=gate)


async def _async_rung(args: argparse.Namespace, rung: str, address: str,
                      engine_proc: EngineProcess) -> dict[str, Any]:
    spec = _spec(args, rung)
    ids = prompt(spec.prompt_len)
    config = EngineCoreClientConfig(transport=HandshakeTransport(address), ready_timeout=60)
    result: dict[str, Any] = {}
    if rung == "engine":
        async with EngineCoreClient.connect(config) as engine:
            await _engine_round(engine, "warm", 64, 8, ids)
            freeze_gc()
            meter = Meter(spec, engine_proc)
            n = 0
            while meter.more():
                await engine.pause_scheduler("keep", False)
                started = meter.start()
                tokens = await _engine_round(engine, f"r{n}", spec.concurrency, spec.tokens,
                                             ids, gate=True)
                meter.stop(started, tokens=tokens)
                n += 1
    else:
        async with Client.connect(ClientConfig(engine=config)) as client:
            await _generate_round(client, "warm", 64, 8, ids)
            freeze_gc()
            meter = Meter(spec, engine_proc)
            n = 0
            while meter.more():
                await client.engine.pause_scheduler("keep", False)
                started = meter.start()
                tokens = await _generate_round(client, f"r{n}", spec.concurrency,
                                               spec.tokens, ids, gate=True)
                meter.stop(started, tokens=tokens)
                n += 1
            if args.calls:
                await client.engine.pause_scheduler("keep", False)
                profiler = cProfile.Profile()
                profiler.enable()
                tokens = await _generate_round(client, "prof", spec.concurrency, spec.tokens,
                                               ids, gate=True)
                profiler.disable()
                stats = pstats.Stats(profiler)
                calls = sum(v[1] for v in stats.stats.values())  # type: ignore[attr-defined]
                top = sorted(stats.stats.items(),  # type: ignore[attr-defined]
                             key=lambda kv: kv[1][2], reverse=True)[:20]
                result["calls_per_token"] = calls / tokens
                result["top_tottime"] = [
                    [f"{Path(k[0]).name}:{k[1]}({k[2]})", v[1] / tokens,
                     round(100 * v[2] / stats.total_tt, 1)]  # type: ignore[attr-defined]
                    for k, v in top]
    result.update(summarise(spec, meter.samples, meter.window()))
    return result


def _run_rung(args: argparse.Namespace, rung: str) -> dict[str, Any]:
    if rung in ("floor", "decode"):
        return _sync_rung(args, rung)
    address = f"tcp://127.0.0.1:{free_port()}"
    with EngineProcess(address, _spec(args, rung)) as engine_proc:
        backend, options = args.backend, {}
        if backend == "uvloop":
            backend, options = "asyncio", {"use_uvloop": True}
        result: dict[str, Any] = anyio.run(_async_rung, args, rung, address, engine_proc,
                                           backend=backend, backend_options=options)
        return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--backend", choices=("asyncio", "uvloop", "trio"), default="asyncio")
    parser.add_argument("--min-time", type=float, default=2.0)
    parser.add_argument("--calls", action="store_true",
                        help="cProfile one round of the generate rung (call counts)")
    parser.add_argument("--rung", choices=RUNGS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rung:  # a child process: one rung, JSON on stdout
        gc.collect()
        print(json.dumps(_run_rung(args, args.rung)))
        return 0
    rows: list[tuple[str, dict[str, Any]]] = []
    for rung in RUNGS:
        cmd = [sys.executable, __file__, "--rung", rung, "--concurrency",
               str(args.concurrency), "--tokens", str(args.tokens), "--backend", args.backend,
               "--min-time", str(args.min_time)] + (["--calls"] if args.calls else [])
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        rows.append((rung, json.loads(out.strip().splitlines()[-1])))
    print(f"{args.concurrency} streams x {args.tokens} tokens, backend {args.backend} "
          f"(floor and decode are synchronous); client CPU per delivered token:")
    previous = None
    for rung, r in rows:
        us = r["cpu_us_per_token"]
        step = "" if previous is None else f"  (+{us - previous:.2f} us for this layer)"
        print(f"  {rung:9} {us:6.2f} us/token  {r['tokens_per_s']:>11,.0f} tok/s  "
              f"client busy {r['main_busy']:.0%}  others {r['others_cores']:.2f} cores{step}")
        previous = us
    generate = rows[-1][1]
    if "calls_per_token" in generate:
        print(f"generate rung under cProfile: {generate['calls_per_token']:.1f} Python "
              f"function calls per delivered token; most own time:")
        for name, per_token, pct in generate["top_tottime"]:
            print(f"  {pct:5.1f}%  {per_token:5.2f} calls/token  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
