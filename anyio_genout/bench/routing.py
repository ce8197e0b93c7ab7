"""The routing benchmark: prefix-aware vs load-only routing over mock engines with a prefix
cache (issue #17).

One run measures, for each workload, both routers on fresh engines (cold caches), in one
process: ``engines`` mock engines (paced steps, a prefix cache of ``cache_blocks`` blocks,
a prefill cost per prompt token not found cached) served by one
:class:`~anyio_genout.EngineCoreClient` with ``routing="load"`` or ``"prefix"``, loaded by
``concurrency`` closed-loop workers. Workload ``shared``: each request is one of
``systems`` system prompts (``system_blocks`` blocks) followed by a user suffix of its own;
``unshared``: every prompt is its own (the same lengths). Reported per cell: the
cached-token fraction (prompt tokens the engines reported cached in the first output's
prefill stats, over all prompt tokens), output tokens/s, and time to first token (median,
p90), and what the router decided. docs/routing.md has the table and how to read it.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from typing import Any, Final

import anyio
import attrs

from ..engine import (
    EngineCoreClient,
    EngineCoreClientConfig,
    HandshakeTransport,
    HealthConfig,
    RoutingConfig,
)
from ..mock import MockEngine, MockEngineConfig
from ..protocol import EngineCoreRequest, SamplingParams
from ..transport import free_tcp_address

__all__ = ["ROUTINGS", "WORKLOADS", "BenchSettings", "CellResult", "make_workload",
           "markdown_table", "median_results", "run_benchmark", "run_cell", "summary"]

WORKLOADS: Final = ("shared", "unshared")
ROUTINGS: Final = ("load", "prefix")
_BLOCK: Final = 16
_VOCAB: Final = 32000


@attrs.frozen(kw_only=True)
class BenchSettings:
    """The shape of a run (the defaults are the documented one)."""

    engines: int = 4
    requests: int = 1024
    concurrency: int = 128
    systems: int = 32
    system_blocks: int = 8
    user_tokens: tuple[int, int] = (24, 56)
    max_tokens: tuple[int, int] = (16, 32)
    max_num_seqs: int = 32
    step_time: float = 0.01
    prefill_time_per_token: float = 2e-5
    cache_blocks: int = 160
    imbalance_threshold: float | None = None  # None: the router's default
    seed: int = 0


@attrs.frozen
class CellResult:
    """One workload under one router."""

    workload: str
    routing: str
    requests: int
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    seconds: float
    ttft_p50: float
    ttft_p90: float
    router_stats: dict[str, int]

    @property
    def cached_fraction(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0

    def to_json(self) -> dict[str, Any]:
        data = attrs.asdict(self)
        data.update(cached_fraction=self.cached_fraction,
                    tokens_per_second=self.tokens_per_second)
        return data


def make_workload(name: str, settings: BenchSettings) -> list[tuple[list[int], int]]:
    """The (prompt, max_tokens) of each request of workload ``name``, in arrival order
    (deterministic for a seed)."""
    rng = random.Random(f"{settings.seed}:{name}")
    system_len = settings.system_blocks * _BLOCK
    systems = [[rng.randrange(1, _VOCAB) for _ in range(system_len)]
               for _ in range(settings.systems)]
    out = []
    for _ in range(settings.requests):
        user = [rng.randrange(1, _VOCAB) for _ in range(rng.randint(*settings.user_tokens))]
        if name == "shared":
            head = systems[rng.randrange(settings.systems)]
        elif name == "unshared":
            head = [rng.randrange(1, _VOCAB) for _ in range(system_len)]
        else:
            raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}, got {name!r}")
        out.append((head + user, rng.randint(*settings.max_tokens)))
    return out


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


async def run_cell(workload: str, routing: str, settings: BenchSettings) -> CellResult:
    """Fresh engines and a fresh client; every request of the workload; the result."""
    requests = make_workload(workload, settings)
    address = free_tcp_address()
    knobs: dict[str, Any] = {}
    if settings.imbalance_threshold is not None:
        knobs["prefix_imbalance_threshold"] = settings.imbalance_threshold
    config = EngineCoreClientConfig(
        transport=HandshakeTransport(address), engine_count=settings.engines,
        routing=RoutingConfig(routing, **knobs),  # type: ignore[arg-type]
        health=HealthConfig(liveness_interval=None))
    ttfts: list[float] = []
    totals = {"prompt": 0, "cached": 0, "output": 0}
    async with anyio.create_task_group() as engines:
        for rank in range(settings.engines):
            engine = MockEngine(MockEngineConfig(
                rank=rank, handshake_address=address, max_num_seqs=settings.max_num_seqs,
                step_time=settings.step_time, keep_history=False,
                prefix_cache_blocks=settings.cache_blocks,
                prefill_time_per_token=settings.prefill_time_per_token))
            engines.start_soon(engine.serve)
        async with EngineCoreClient.connect(config) as client:
            queue = iter(enumerate(requests))

            async def worker() -> None:
                for index, (prompt, max_tokens) in queue:
                    request = EngineCoreRequest(
                        request_id=f"{workload}-{index}", prompt_token_ids=prompt,
                        sampling_params=SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                       ignore_eos=True),
                        arrival_time=time.time())
                    sent = time.perf_counter()
                    first = True
                    async with client.call(request) as stream:
                        async for item in stream:
                            output = item.output
                            if first:
                                first = False
                                ttfts.append(time.perf_counter() - sent)
                                if output.prefill_stats is not None:
                                    totals["cached"] += output.prefill_stats.num_cached_tokens
                            totals["output"] += len(output.new_token_ids)
                    totals["prompt"] += len(prompt)

            start = time.perf_counter()
            async with anyio.create_task_group() as workers:
                for _ in range(settings.concurrency):
                    workers.start_soon(worker)
            seconds = time.perf_counter() - start
            stats = attrs.asdict(client.router.stats)
        engines.cancel_scope.cancel()
    return CellResult(workload, routing, len(requests), totals["prompt"], totals["cached"],
                      totals["output"], seconds, _percentile(ttfts, 0.5),
                      _percentile(ttfts, 0.9), stats)


async def run_benchmark(settings: BenchSettings, workloads: Sequence[str] = WORKLOADS,
                        routings: Sequence[str] = ROUTINGS) -> list[CellResult]:
    """Every workload under every router, one after the other (load first)."""
    return [await run_cell(w, r, settings) for w in workloads for r in routings]


def markdown_table(results: Sequence[CellResult]) -> str:
    """The results as a Markdown table, with prefix-vs-load ratios per workload."""
    lines = ["| workload | routing | cached-token fraction | output tokens/s | TTFT p50 (ms) "
             "| TTFT p90 (ms) | by prefix / by load / overloaded |",
             "|---|---|---:|---:|---:|---:|---|"]
    by_key = {(r.workload, r.routing): r for r in results}
    for r in results:
        s = r.router_stats
        lines.append(f"| {r.workload} | {r.routing} | {r.cached_fraction:.3f} | "
                     f"{r.tokens_per_second:,.0f} | {r.ttft_p50 * 1e3:.1f} | "
                     f"{r.ttft_p90 * 1e3:.1f} | {s['by_prefix']} / {s['by_load']} / "
                     f"{s['overloaded']} |")
    ratios = []
    for workload in dict.fromkeys(r.workload for r in results):
        load, prefix = by_key.get((workload, "load")), by_key.get((workload, "prefix"))
        if load is None or prefix is None:
            continue
        cached = (f"{prefix.cached_fraction / load.cached_fraction:.2f}x"
                  if load.cached_fraction else "inf" if prefix.cached_fraction else "-")
        tps = prefix.tokens_per_second / load.tokens_per_second if load.seconds else 0.0
        ttft = prefix.ttft_p50 / load.ttft_p50 if load.ttft_p50 else 0.0
        ratios.append(f"{workload}: prefix/load cached fraction {cached}, tokens/s "
                      f"{tps:.3f}x, TTFT p50 {ttft:.2f}x")
    return "\n".join(lines) + ("\n\n" + "\n".join(ratios) if ratios else "")


def summary(settings: BenchSettings) -> str:
    """One line describing the run's shape (for the report)."""
    s = settings
    return (f"{s.engines} mock engines (max_num_seqs {s.max_num_seqs}, step {s.step_time * 1e3:g} "
            f"ms, prefill {s.prefill_time_per_token * 1e6:g} us per uncached prompt token, "
            f"prefix cache {s.cache_blocks} blocks of {_BLOCK}); {s.requests} requests, "
            f"{s.concurrency} at a time; shared: {s.systems} system prompts of "
            f"{s.system_blocks} blocks + a user suffix of {s.user_tokens[0]}-"
            f"{s.user_tokens[1]} tokens; {s.max_tokens[0]}-{s.max_tokens[1]} output tokens")


def median_results(runs: Sequence[Sequence[CellResult]]) -> list[CellResult]:
    """Per cell, the run with the median tokens/s (repeats smooth a busy machine)."""
    out = []
    for cells in zip(*runs, strict=True):
        ordered = sorted(cells, key=lambda c: c.tokens_per_second)
        out.append(ordered[len(ordered) // 2])
    return out
