"""vLLM's side of ``anyio-genout bench text``: ``AsyncLLM`` detokenizing, on the same engine.

Runs where vLLM is installed (the interop environment), all of a repeat's concurrencies in
one process (AsyncLLM's handshake is one-shot)::

    python -m anyio_genout.bench.text_vllm SPECS_JSON RESULT_PATH [--loop uvloop]

The mock engine (corpus mode, as for our cells) dials in first; ``AsyncLLM`` then loads the
tokenizer of the specs' model folder (``skip_tokenizer_init=False``: the tiny model's config
with the bundled tokenizer, :func:`.text.make_model_dir`) and runs the variants of
:mod:`.text` with ``TokensPrompt`` and ``SamplingParams(max_tokens=T, ignore_eos=True,
output_kind=DELTA, detokenize=...)``, their rounds alternating as in our cells, each output's
``text`` read as an application reads it.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib
import json
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .measure import EngineProcess, Meter, free_port, freeze_gc
from .spec import Result, summarise
from .text import TextSpec, engine_args, rotate, text_prompts
from .vllm_ref import prepare_vllm_process, run_on_loop

__all__ = ["main"]


class _Runner:
    def __init__(self, llm: Any, params_cls: Any, kind: Any, prompt_cls: Any) -> None:
        self.llm = llm
        self.params_cls = params_cls
        self.kind = kind
        self.prompt_cls = prompt_cls
        self.ids = 0

    def params(self, spec: TextSpec, variant: str, tokens: int) -> Any:
        stop = list(spec.stop) if variant == "text-stop2" else None
        return self.params_cls(max_tokens=tokens, ignore_eos=True, temperature=0.0,
                               output_kind=self.kind, detokenize=variant != "tokens",
                               stop=stop)

    async def one(self, ids: list[int], params: Any, tag: str) -> tuple[int, int]:
        n = 0
        chars = 0
        self.ids += 1
        request = self.prompt_cls(prompt_token_ids=ids)
        async for out in self.llm.generate(request, params, f"{tag}-{self.ids}"):
            completion = out.outputs[0]
            n += len(completion.token_ids)
            chars += len(completion.text or "")
        return n, chars

    async def streams(self, prompts: Sequence[list[int]], params: Any, tag: str, *,
                      release: bool) -> tuple[int, int]:
        """One stream per prompt; ``release``: resume the paused engine once every request
        has been sent (as :meth:`.vllm_ref._Runner.streams` does)."""
        jobs = asyncio.gather(*(self.one(p, params, tag) for p in prompts))
        if release:
            processor = self.llm.output_processor
            for _ in range(1_000_000):  # AsyncLLM offers no event for "request sent"
                if processor.get_num_unfinished_requests() >= len(prompts):
                    break
                await asyncio.sleep(0)
            for _ in range(3):  # a request is registered just before its ADD is sent
                await asyncio.sleep(0)
            await self.llm.engine_core.call_utility_async("resume_scheduler")
        found = await jobs
        return sum(n for n, _ in found), sum(c for _, c in found)

    async def measure(self, spec: TextSpec, corpus: list[int], engine: EngineProcess
                      ) -> Result:
        prompts = text_prompts(corpus, spec.concurrency, spec.prompt_len)
        gate = spec.concurrency > 1
        meters = {v: Meter(spec.cell(v), engine) for v in spec.variants}
        chars = dict.fromkeys(spec.variants, 0)
        complete = True
        rounds = 0
        while rounds < spec.min_rounds or (
                rounds < spec.max_rounds
                and min(sum(s.wall for s in m.samples) for m in meters.values())
                < spec.min_time):
            for variant in rotate(spec.variants, rounds):
                params = self.params(spec, variant, spec.tokens)
                if gate:
                    await self.llm.engine_core.call_utility_async(
                        "pause_scheduler", "keep", False)
                started = meters[variant].start()
                tokens, text = await self.streams(prompts, params, f"{variant}{rounds}",
                                                  release=gate)
                chars[variant] += text
                meters[variant].stop(started, tokens=tokens, requests=spec.concurrency)
                complete = complete and tokens == spec.concurrency * spec.tokens
            rounds += 1
        return {"complete": complete, "rounds": rounds,
                "variants": {v: {**summarise(m.spec, m.samples), "chars": chars[v]}
                             for v, m in meters.items()}}


async def _run_all(specs: list[TextSpec], corpus: list[int], engine: EngineProcess,
                   address: str) -> list[Result]:
    # Imported by name: vLLM exists only in the interop environment.
    vllm: Any = importlib.import_module("vllm")
    arg_utils: Any = importlib.import_module("vllm.engine.arg_utils")
    inputs: Any = importlib.import_module("vllm.inputs")
    sampling: Any = importlib.import_module("vllm.sampling_params")
    async_llm: Any = importlib.import_module("vllm.v1.engine.async_llm")
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    args = arg_utils.AsyncEngineArgs(
        model=specs[0].model_dir, skip_tokenizer_init=False, data_parallel_size=1,
        data_parallel_size_local=0, data_parallel_address=host,
        data_parallel_rpc_port=int(port), disable_log_stats=True,
    )
    started = time.monotonic()
    llm = async_llm.AsyncLLM.from_engine_args(args)
    startup_s = time.monotonic() - started
    results: list[Result] = []
    try:
        runner = _Runner(llm, vllm.SamplingParams, sampling.RequestOutputKind.DELTA,
                         inputs.TokensPrompt)
        warm = text_prompts(corpus, 64, specs[0].prompt_len)
        for variant in specs[0].variants:  # warm-up: every code path, unmeasured
            await runner.streams(warm, runner.params(specs[0], variant, 8), f"w{variant}",
                                 release=False)
        frozen = freeze_gc()
        for spec in specs:
            try:
                result = {**spec.to_json(), **await runner.measure(spec, corpus, engine)}
            except Exception as exc:
                traceback.print_exc()
                result = {**spec.to_json(), "error": f"{type(exc).__name__}: {exc}"}
            result.update(gc_frozen_objects=frozen, startup_s=startup_s,
                          gc_collections=[s["collections"] for s in gc.get_stats()])
            results.append(result)
    finally:
        llm.shutdown()
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m anyio_genout.bench.text_vllm")
    parser.add_argument("specs", help="JSON list of text cell specs (impl 'vllm')")
    parser.add_argument("output", help="where to write the JSON list of results")
    parser.add_argument("--loop", choices=("asyncio", "uvloop"), default="uvloop")
    args = parser.parse_args(argv)
    specs = [TextSpec.from_json(item) for item in json.loads(args.specs)]
    if not specs:
        return 0
    prepare_vllm_process()
    corpus = json.loads(Path(specs[0].corpus_file).read_text())
    address = f"tcp://127.0.0.1:{free_port()}"
    status = 0
    with EngineProcess(address, specs[0].cell("text"),
                       extra=engine_args(specs[0].corpus_file, specs[0].model_dir)) as engine:
        try:
            results = run_on_loop(lambda: _run_all(specs, corpus, engine, address),
                                  args.loop)
        except BaseException as exc:
            traceback.print_exc()
            results = [{**s.to_json(), "error": f"{type(exc).__name__}: {exc}"} for s in specs]
            status = 1
    Path(args.output).write_text(json.dumps(results, indent=1, default=str))
    return status


if __name__ == "__main__":
    sys.exit(main())
