"""The per-step families of vLLM 0.32 beyond the 27 of :mod:`.exposition`: what the engine's
steps, its scheduler statistics and the client's own calls fill.

* ``vllm:iteration_tokens_total`` (histogram): per batch of outputs an engine sent, the prompt
  tokens computed (``prefill_stats.num_computed_tokens`` of the requests prefilled in it)
  plus the tokens generated, for the requests the client still tracks: vLLM's
  ``IterationStats`` (``prompt_token_stats.computed + num_generation_tokens``);
* ``vllm:prompt_tokens_cached_by_source`` (``source``): ``device`` adds each step's
  ``prefix_cache_stats.hits``, the other tiers the connector's ``hits_by_source``;
* ``vllm:external_prefix_cache_queries`` / ``_hits``: ``connector_prefix_cache_stats``;
* ``vllm:estimated_flops_per_gpu_total``, ``vllm:estimated_read_bytes_per_gpu_total``,
  ``vllm:estimated_write_bytes_per_gpu_total``: ``perf_stats`` (an engine started with
  vLLM's MFU metrics sends them; none otherwise, and they stay at 0);
* ``vllm:mm_cache_queries`` / ``_hits``: vLLM's front-end multi-modal processor cache. The
  client has no such cache (it refuses multi-modal input), so they are 0, as ``vllm serve``'s
  are for a text-only model;
* ``vllm:engine_sleep_state`` (``sleep_state``): set by the client's own
  ``engine.sleep()`` / ``engine.wake_up()`` (a full wake-up), for every engine, as vLLM's
  ``record_sleep_state``: awake 1 until then;
* ``vllm:admission_rejections`` (``model_name`` and ``reason`` only): vLLM's
  ``--max-num-queued-reqs`` / ``--max-num-queued-tokens`` refusals. The client has neither
  limit, so both reasons stay at 0.

Malformed statistics never fail the reader that records them: a value that is not a
non-negative integer is skipped (the decoder validates the fields the client relies on).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from .buckets import ITERATION_TOKENS_BUCKETS
from .histogram import Histogram
from .labels import ADMISSION_REASONS, CACHE_HIT_SOURCES, LABELS, SLEEP_STATES

__all__ = ["SleepState", "StepSeries", "step_families"]

_PERF: Final = ("num_flops_per_gpu", "num_read_bytes_per_gpu", "num_write_bytes_per_gpu")


def _count(value: object) -> int:
    """``value`` if it is a non-negative int (not a bool), else 0."""
    return value if type(value) is int and value > 0 else 0


class StepSeries:
    """One engine's per-step values (see the module docstring)."""

    __slots__ = ("cached_by_source", "external_hits", "external_queries", "iteration_tokens",
                 "perf")

    def __init__(self) -> None:
        self.iteration_tokens = Histogram(ITERATION_TOKENS_BUCKETS)
        self.cached_by_source = dict.fromkeys(CACHE_HIT_SOURCES, 0)
        self.external_queries = 0
        self.external_hits = 0
        #: ``num_flops_per_gpu``, ``num_read_bytes_per_gpu``, ``num_write_bytes_per_gpu``.
        self.perf = [0, 0, 0]

    def observe(self, hits: int, raw: Mapping[str, Any]) -> None:
        """One step's scheduler statistics: ``hits`` its prefix-cache hits, ``raw`` its map."""
        if hits > 0:
            self.cached_by_source["device"] += hits
        connector = raw.get("connector_prefix_cache_stats")
        if type(connector) is dict:
            self.external_queries += _count(connector.get("queries"))
            self.external_hits += _count(connector.get("hits"))
            by_source = connector.get("hits_by_source")
            if type(by_source) is dict:
                cached = self.cached_by_source
                for source, tokens in by_source.items():
                    if source in cached:
                        cached[source] += _count(tokens)
        perf = raw.get("perf_stats")
        if type(perf) is dict:
            values = [_count(perf.get(name)) for name in _PERF]
            if any(values):  # vLLM's PerfMetricsProm skips an all-zero step
                for i, v in enumerate(values):
                    self.perf[i] += v


class SleepState:
    """``vllm:engine_sleep_state``'s three values, shared by every engine of a client."""

    __slots__ = ("values",)

    def __init__(self) -> None:
        self.values = (1.0, 0.0, 0.0)  # awake, weights_offloaded, discard_all

    def record(self, sleep: int, level: int) -> None:
        """vLLM's ``record_sleep_state``: asleep at ``level`` (1: weights offloaded, 2:
        everything discarded; 0: the KV cache released) or, with ``sleep`` 0, awake."""
        if sleep != 1:
            self.values = (1.0, 0.0, 0.0)
        else:
            self.values = (0.0, 1.0 if level == 1 else 0.0, 1.0 if level == 2 else 0.0)


def step_families(engines: Sequence[tuple[tuple[str, str], StepSeries]], sleep: SleepState,
                  model_name: str, iteration_les: tuple[str, ...], *,
                  describe: bool = False) -> list[Metric]:
    """The families of this module for ``engines``, ``(labels, series)`` pairs (copies the
    caller made); with ``describe``, without samples."""

    def counter(name: str, doc: str, values: Sequence[float]) -> Metric:
        family = CounterMetricFamily(name, doc, labels=LABELS)
        for (labels, _), v in zip(engines, values, strict=True):
            family.add_metric(labels, float(v))
        return family

    steps = [s for _, s in engines]
    iteration = HistogramMetricFamily(
        "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
        labels=LABELS)
    for labels, s in engines:
        cumulative, buckets = 0.0, []
        for le, count in zip(iteration_les, list(s.iteration_tokens.counts), strict=True):
            cumulative += count
            buckets.append((le, cumulative))
        iteration.add_metric(labels, buckets, s.iteration_tokens.sum)
    sleeping = GaugeMetricFamily(
        "vllm:engine_sleep_state",
        "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is "
        "awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
        labels=(*LABELS, "sleep_state"))
    values = sleep.values
    for labels, _ in engines:
        for state, value in zip(SLEEP_STATES, values, strict=True):
            sleeping.add_metric((*labels, state), value)
    by_source = CounterMetricFamily(
        "vllm:prompt_tokens_cached_by_source",
        "Prefix-cache hit tokens by the cache tier that supplied them: device (local HBM), "
        "host (offloaded to DRAM), disk, p2p (transferred from another vLLM instance) or "
        "external_unspecified. Counted at admission; sums to vllm:prefix_cache_hits + "
        "vllm:external_prefix_cache_hits.",
        labels=(*LABELS, "source"))
    for source in CACHE_HIT_SOURCES:  # vLLM creates the children tier by tier
        for labels, s in engines:
            by_source.add_metric((*labels, source), float(s.cached_by_source[source]))
    admission = CounterMetricFamily(
        "vllm:admission_rejections",
        "Number of admission attempts rejected by a queue limit, by reason.",
        labels=("model_name", "reason"))
    for reason in () if describe else ADMISSION_REASONS:
        admission.add_metric((model_name, reason), 0.0)
    zeros = [0] * len(engines)
    mfu = "(for Model Flops Utilization calculations)."
    return [
        sleeping,
        counter("vllm:external_prefix_cache_queries",
                "External prefix cache queries from KV connector cross-instance cache "
                "sharing, in terms of number of queried tokens.",
                [s.external_queries for s in steps]),
        counter("vllm:external_prefix_cache_hits",
                "External prefix cache hits from KV connector cross-instance cache sharing, "
                "in terms of number of cached tokens.", [s.external_hits for s in steps]),
        counter("vllm:mm_cache_queries",
                "Multi-modal cache queries, in terms of number of queried items.", zeros),
        counter("vllm:mm_cache_hits",
                "Multi-modal cache hits, in terms of number of cached items.", zeros),
        by_source,
        admission,
        iteration,
        counter("vllm:estimated_flops_per_gpu_total",
                f"Estimated number of floating point operations per GPU {mfu}",
                [s.perf[0] for s in steps]),
        counter("vllm:estimated_read_bytes_per_gpu_total",
                f"Estimated number of bytes read from memory per GPU {mfu}",
                [s.perf[1] for s in steps]),
        counter("vllm:estimated_write_bytes_per_gpu_total",
                f"Estimated number of bytes written to memory per GPU {mfu}",
                [s.perf[2] for s in steps]),
    ]
