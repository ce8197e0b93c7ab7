"""Prometheus metrics with vLLM's names, labels and buckets, recorded by the client.

:class:`Metrics` owns, per engine index, the recorded state (:class:`_EngineSeries`) and
exposes it through one custom collector (in a private :class:`CollectorRegistry` unless one
is given). Each request gets a :class:`RequestTracker` that folds the engine's outputs into
timing state and records:

* per output (hot path): ``vllm:generation_tokens``, ``vllm:num_preemptions``, prompt-token
  counters and TTFT on the first token-bearing output, ITL on later ones;
* once, at the end (:meth:`RequestTracker.record_finished`): ``vllm:request_success`` and the
  per-request histograms, whose values are queued and folded in with numpy a batch at a
  time (when 1,024 are queued, and before every scrape): 0.9 us a request instead of 2.2 for
  observing thirteen values one by one.

Recording touches plain Python numbers only: a counter is an ``int`` attribute of the
engine's series, a gauge a ``float``, a histogram a :class:`_Histogram` (per-bucket counts
found with :func:`bisect.bisect_left` on the bucket bounds, and a running sum). No
prometheus-client object and no lock is involved per output: a decode output costs about a
sixth of what three ``Counter.inc`` and a ``Histogram.observe`` did. The metric families are
built when the registry is collected (:class:`_Exposition`), with the values, sample order
and ``le`` strings prometheus-client's own ``Counter`` / ``Gauge`` / ``Histogram`` children
would produce, minus the ``_created`` series.

Threads: recording happens on the event loop's thread; a scrape may run on another one
(``prometheus_client.start_http_server``). The collector copies what it reads (the engine
dict, the bucket counts) before iterating, so a concurrent scrape never fails; it may see an
update half applied (a histogram's ``_sum`` one observation ahead of its buckets), which the
next scrape corrects. Folding the queued finished requests takes a lock (the loop skips its
own fold while a scrape folds), and each queued request is taken exactly once. Values live
in this process only (no prometheus multiprocess mode).

Clocks (never mixed): ``arrival_time`` and ``received_at`` are the front end's ``time.time()``
(only TTFT and end-to-end latency use them); the batch timestamps and event timestamps are the
engine's ``time.monotonic()`` (ITL and the phase times).

Scheduler statistics (:meth:`Metrics.observe_scheduler_stats`) set the per-engine gauges and
add the step's prefix-cache increments. The same per-engine numbers feed the periodic logger
(:meth:`Metrics.snapshot`).
"""

from __future__ import annotations

import math
import threading
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Final

import attrs
import numpy as np
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from ..protocol.outputs import (
    EngineCoreEvent,
    EngineCoreEventType,
    EngineCoreFinishReason,
    EngineCoreOutput,
    PrefillStats,
    SchedulerStats,
)
from .buckets import (
    INTER_TOKEN_LATENCY_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    REQUEST_NUM_PREEMPTIONS_BUCKETS,
    REQUEST_PARAMS_N_BUCKETS,
    TIME_TO_FIRST_TOKEN_BUCKETS,
    build_1_2_5_buckets,
)

__all__ = [
    "FINISHED_REASONS",
    "PROMPT_TOKEN_SOURCES",
    "WAITING_REASONS",
    "EngineTotals",
    "Metrics",
    "RequestTracker",
    "finish_reason_label",
]

#: ``finished_reason`` label values, indexed by :class:`EngineCoreFinishReason`.
FINISHED_REASONS: Final = ("stop", "length", "abort", "error", "repetition")
#: ``source`` label values of ``vllm:prompt_tokens_by_source``.
PROMPT_TOKEN_SOURCES: Final = ("local_compute", "local_cache_hit", "external_kv_transfer")
#: ``reason`` label values of ``vllm:num_requests_waiting_by_reason``.
WAITING_REASONS: Final = ("capacity", "deferred")

_LABELS: Final = ("model_name", "engine")
_QUEUED: Final = EngineCoreEventType.QUEUED
_SCHEDULED: Final = EngineCoreEventType.SCHEDULED
_PREEMPTED: Final = EngineCoreEventType.PREEMPTED
_ITL_BOUNDS: Final = INTER_TOKEN_LATENCY_BUCKETS
_TOKENS: Final = None  # marks the token-count histograms, bounded by ``max_model_len``


def finish_reason_label(reason: EngineCoreFinishReason) -> str:
    """The ``finished_reason`` label of ``reason`` (``LENGTH`` -> ``"length"``)."""
    return FINISHED_REASONS[reason]


@attrs.frozen
class EngineTotals:
    """Running totals for one engine, as read by the periodic stats logger.

    Counters are cumulative since the :class:`Metrics` object was created; the gauges hold the
    latest scheduler statistics (all zero until the first, see ``has_scheduler_stats``).
    """

    engine_index: int
    #: Prompt tokens prefilled locally (``vllm:prompt_tokens_by_source{source="local_compute"}``).
    computed_prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_running: int = 0
    #: Capacity-waiting plus deferred requests, as ``vllm:num_requests_waiting``.
    num_waiting: int = 0
    #: 0..1 (``vllm:kv_cache_usage_perc``).
    kv_cache_usage: float = 0.0
    has_scheduler_stats: bool = False


class _Histogram:
    """One labelled histogram: a count per bucket (the last one is ``+Inf``) and the sum.

    Same semantics as ``prometheus_client.Histogram.observe``: a value goes to the first
    bucket whose bound is ``>=`` it; NaN goes to no bucket (so not into ``_count``) but is
    added to ``_sum``.
    """

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        #: The finite upper bounds, ascending.
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        i = bisect_left(self.bounds, value)
        if i or value == value:  # NaN compares false to every bound: bisect gives 0
            self.counts[i] += 1
        self.sum += value

    def observe_many(self, values: np.ndarray[Any, np.dtype[np.float64]]) -> None:
        """:meth:`observe` each of ``values`` in order: the same counts, and the same sum to
        the last bit (a running sum, as one observation after another would make)."""
        bins = np.bincount(
            np.searchsorted(np.asarray(self.bounds), values[~np.isnan(values)], side="left"),
            minlength=len(self.counts))
        counts = self.counts
        for i in np.flatnonzero(bins).tolist():
            counts[i] += int(bins[i])
        self.sum = float(np.cumsum(np.concatenate(([self.sum], values)))[-1])


# The histograms in exposition order: (attribute of _EngineSeries, name, documentation, bounds);
# bounds of ``_TOKENS`` are ``build_1_2_5_buckets(max_model_len)``.
_HISTOGRAMS: Final[tuple[tuple[str, str, str, tuple[float, ...] | None], ...]] = (
    ("time_to_first_token", "vllm:time_to_first_token_seconds",
     "Histogram of time to first token in seconds.", TIME_TO_FIRST_TOKEN_BUCKETS),
    ("inter_token_latency", "vllm:inter_token_latency_seconds",
     "Histogram of inter-token latency in seconds.", INTER_TOKEN_LATENCY_BUCKETS),
    ("e2e_request_latency", "vllm:e2e_request_latency_seconds",
     "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS),
    ("queue_time", "vllm:request_queue_time_seconds",
     "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS),
    ("inference_time", "vllm:request_inference_time_seconds",
     "Histogram of time spent in RUNNING phase for request.", REQUEST_LATENCY_BUCKETS),
    ("prefill_time", "vllm:request_prefill_time_seconds",
     "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS),
    ("decode_time", "vllm:request_decode_time_seconds",
     "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS),
    ("time_per_output_token", "vllm:request_time_per_output_token_seconds",
     "Histogram of time_per_output_token_seconds per request.", INTER_TOKEN_LATENCY_BUCKETS),
    ("request_prompt_tokens", "vllm:request_prompt_tokens",
     "Number of prefill tokens processed.", _TOKENS),
    ("request_generation_tokens", "vllm:request_generation_tokens",
     "Number of generation tokens processed.", _TOKENS),
    ("request_max_num_generation_tokens", "vllm:request_max_num_generation_tokens",
     "Histogram of maximum number of requested generation tokens.", _TOKENS),
    ("request_params_max_tokens", "vllm:request_params_max_tokens",
     "Histogram of the max_tokens request parameter.", _TOKENS),
    ("request_params_n", "vllm:request_params_n",
     "Histogram of the n request parameter.", REQUEST_PARAMS_N_BUCKETS),
    ("request_num_preemptions", "vllm:request_num_preemptions",
     "Histogram of the number of times a request was preempted.",
     REQUEST_NUM_PREEMPTIONS_BUCKETS),
    ("request_prefill_kv_computed_tokens", "vllm:request_prefill_kv_computed_tokens",
     "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
     _TOKENS),
)


#: The histograms :meth:`RequestTracker.record_finished` fills, in the order of the values it
#: queues per request (:meth:`_EngineSeries.fold` folds them in, a batch at a time).
_FINISH_COLUMNS: Final = (
    "e2e_request_latency", "queue_time", "prefill_time", "decode_time", "inference_time",
    "time_per_output_token", "request_prompt_tokens", "request_generation_tokens",
    "request_max_num_generation_tokens", "request_params_max_tokens", "request_params_n",
    "request_prefill_kv_computed_tokens", "request_num_preemptions",
)
#: Column of ``vllm:request_params_max_tokens``, where NaN means "not observed" (a request
#: without max_tokens); its values are otherwise whole numbers, never NaN.
_MAX_TOKENS_COLUMN: Final = _FINISH_COLUMNS.index("request_params_max_tokens")
#: Finished requests queued per engine before the loop folds them in itself.
_FOLD_AT: Final = 1024


class _EngineSeries:
    """One engine's recorded values: counters (ints), gauges (floats), histograms.

    The counters double as the logger's running totals (``generation_tokens``,
    ``prompt_local_compute``, ``prefix_cache_queries``, ``prefix_cache_hits``).
    """

    __slots__ = (
        "_fold_lock",
        "_success_order",
        "decode_time",
        "e2e_request_latency",
        "engine_index",
        "finished",
        "gauge_kv_cache_usage",
        "gauge_running",
        "gauge_waiting",
        "gauge_waiting_capacity",
        "gauge_waiting_deferred",
        "generation_tokens",
        "has_scheduler_stats",
        "inference_time",
        "itl_counts",
        "itl_last",
        "itl_last_bucket",
        "itl_sum",
        "labels",
        "last_kv_cache_usage",
        "last_running",
        "last_waiting",
        "num_preemptions",
        "prefill_time",
        "prefix_cache_hits",
        "prefix_cache_queries",
        "prompt_external_kv_transfer",
        "prompt_local_cache_hit",
        "prompt_local_compute",
        "prompt_tokens",
        "prompt_tokens_cached",
        "queue_time",
        "request_generation_tokens",
        "request_max_num_generation_tokens",
        "request_num_preemptions",
        "request_params_max_tokens",
        "request_params_n",
        "request_prefill_kv_computed_tokens",
        "request_prompt_tokens",
        "success",
        "time_per_output_token",
        "time_to_first_token",
    )

    def __init__(self, model_name: str, engine_index: int, token_bounds: tuple[float, ...],
                 success_order: list[tuple[_EngineSeries, str]]) -> None:
        self.engine_index = engine_index
        self.labels = (model_name, str(engine_index))
        #: ``vllm:request_success`` per ``finished_reason``; ``success_order`` (shared by the
        #: engines of one :class:`Metrics`) lists the series in order of creation.
        self.success = dict.fromkeys(FINISHED_REASONS, 0)
        self._success_order = success_order
        success_order.extend((self, reason) for reason in FINISHED_REASONS)
        self.prompt_tokens = 0
        self.prompt_local_compute = 0
        self.prompt_local_cache_hit = 0
        self.prompt_external_kv_transfer = 0
        self.prompt_tokens_cached = 0
        self.generation_tokens = 0
        self.num_preemptions = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.gauge_running = 0.0
        self.gauge_waiting = 0.0
        self.gauge_waiting_capacity = 0.0
        self.gauge_waiting_deferred = 0.0
        self.gauge_kv_cache_usage = 0.0
        # The latest scheduler statistics as received (the gauges hold them as floats).
        self.last_running = 0
        self.last_waiting = 0
        self.last_kv_cache_usage = 0.0
        self.has_scheduler_stats = False
        self.time_to_first_token = _Histogram(TIME_TO_FIRST_TOKEN_BUCKETS)
        # vllm:inter_token_latency_seconds, the per-output histogram, is flattened into the
        # series (a _Histogram's counts and sum) to save an attribute load per output, plus
        # the latest value observed and its bucket (NaN: equal to nothing, so not yet any).
        self.itl_counts = [0] * (len(INTER_TOKEN_LATENCY_BUCKETS) + 1)
        self.itl_sum = 0.0
        self.itl_last = math.nan
        self.itl_last_bucket = 0
        self.e2e_request_latency = _Histogram(REQUEST_LATENCY_BUCKETS)
        self.queue_time = _Histogram(REQUEST_LATENCY_BUCKETS)
        self.inference_time = _Histogram(REQUEST_LATENCY_BUCKETS)
        self.prefill_time = _Histogram(REQUEST_LATENCY_BUCKETS)
        self.decode_time = _Histogram(REQUEST_LATENCY_BUCKETS)
        self.time_per_output_token = _Histogram(INTER_TOKEN_LATENCY_BUCKETS)
        self.request_prompt_tokens = _Histogram(token_bounds)
        self.request_generation_tokens = _Histogram(token_bounds)
        self.request_max_num_generation_tokens = _Histogram(token_bounds)
        self.request_params_max_tokens = _Histogram(token_bounds)
        self.request_params_n = _Histogram(REQUEST_PARAMS_N_BUCKETS)
        self.request_num_preemptions = _Histogram(REQUEST_NUM_PREEMPTIONS_BUCKETS)
        self.request_prefill_kv_computed_tokens = _Histogram(token_bounds)
        #: Finished requests' values for the histograms of ``_FINISH_COLUMNS``, not yet
        #: folded in. Appending is all a finish costs the event loop; folding a batch with
        #: numpy costs a fraction of observing each value (docs/performance.md).
        self.finished: deque[tuple[float, ...]] = deque()
        self._fold_lock = threading.Lock()

    def fold(self, *, wait: bool = True) -> None:
        """Fold the queued finished requests into their histograms.

        Called by the collector before reading the histograms (from any thread) and by the
        event loop every ``_FOLD_AT`` requests; ``wait=False`` skips the fold if another
        thread is folding. Each queued row is taken exactly once, so appends made meanwhile
        are never lost.
        """
        if not self._fold_lock.acquire(blocking=wait):
            return
        try:
            queue = self.finished
            rows = [queue.popleft() for _ in range(len(queue))]
            if not rows:
                return
            table = np.array(rows, dtype=np.float64)
            for column, name in enumerate(_FINISH_COLUMNS):
                values = table[:, column]
                if column == _MAX_TOKENS_COLUMN:
                    values = values[~np.isnan(values)]
                histogram: _Histogram = getattr(self, name)
                histogram.observe_many(values)
        finally:
            self._fold_lock.release()

    def count_success(self, reason: str) -> None:
        """+1 on ``vllm:request_success`` for ``reason`` (unknown reasons get a new series)."""
        success = self.success
        count = success.get(reason)
        if count is None:
            success[reason] = 1
            self._success_order.append((self, reason))
        else:
            success[reason] = count + 1

    def record_prompt(self, stats: PrefillStats) -> None:
        """Prompt-token counters from a request's first token-bearing output."""
        if stats.num_prompt_tokens > 0:
            self.prompt_tokens += stats.num_prompt_tokens
        if stats.num_computed_tokens > 0:
            self.prompt_local_compute += stats.num_computed_tokens
        if stats.num_local_cached_tokens > 0:
            self.prompt_local_cache_hit += stats.num_local_cached_tokens
        if stats.num_external_cached_tokens > 0:
            self.prompt_external_kv_transfer += stats.num_external_cached_tokens
        if stats.num_cached_tokens > 0:
            self.prompt_tokens_cached += stats.num_cached_tokens

    def totals(self) -> EngineTotals:
        return EngineTotals(
            self.engine_index,
            self.prompt_local_compute,
            self.generation_tokens,
            self.prefix_cache_queries,
            self.prefix_cache_hits,
            self.last_running,
            self.last_waiting,
            self.last_kv_cache_usage,
            self.has_scheduler_stats,
        )


class _Exposition:
    """The one collector registered for a :class:`Metrics`: builds every family at scrape time.

    The samples are what prometheus-client's ``Counter`` / ``Gauge`` / ``Histogram`` children
    (created per engine in order of first appearance, request-success reasons in order of
    first use) would expose, as floats, without the ``_created`` series. ``describe`` (the
    families without samples) lets the registry detect name clashes without collecting.
    """

    __slots__ = ("_engines", "_les", "_success_order")

    def __init__(self, engines: dict[int, _EngineSeries], token_bounds: tuple[float, ...],
                 success_order: list[tuple[_EngineSeries, str]]) -> None:
        self._engines = engines
        self._success_order = success_order
        # The ``le`` label values of each histogram, formatted as prometheus-client does.
        self._les: dict[str, tuple[str, ...]] = {
            attr: (*map(floatToGoString, token_bounds if bounds is None else bounds), "+Inf")
            for attr, _, _, bounds in _HISTOGRAMS
        }

    def describe(self) -> list[Metric]:
        return self._families((), ())

    def collect(self) -> Iterator[Metric]:
        # Copies first: the event loop may add an engine or a reason meanwhile.
        yield from self._families(tuple(self._engines.values()), tuple(self._success_order))

    def _families(self, engines: Sequence[_EngineSeries],
                  success: Sequence[tuple[_EngineSeries, str]]) -> list[Metric]:
        """Every family, in exposition order (counters, histograms, gauges)."""

        def counter(name: str, doc: str, get: Callable[[_EngineSeries], int]) -> Metric:
            family = CounterMetricFamily(name, doc, labels=_LABELS)
            for e in engines:
                family.add_metric(e.labels, float(get(e)))
            return family

        def gauge(name: str, doc: str, get: Callable[[_EngineSeries], float]) -> Metric:
            family = GaugeMetricFamily(name, doc, labels=_LABELS)
            for e in engines:
                family.add_metric(e.labels, get(e))
            return family

        requests = CounterMetricFamily(
            "vllm:request_success", "Count of successfully processed requests.",
            labels=(*_LABELS, "finished_reason"))
        for e, reason in success:
            requests.add_metric((*e.labels, reason), float(e.success.get(reason, 0)))
        by_source = CounterMetricFamily(
            "vllm:prompt_tokens_by_source", "Number of prompt tokens by source.",
            labels=(*_LABELS, "source"))
        for e in engines:
            for source, tokens in zip(PROMPT_TOKEN_SOURCES, (
                    e.prompt_local_compute, e.prompt_local_cache_hit,
                    e.prompt_external_kv_transfer), strict=True):
                by_source.add_metric((*e.labels, source), float(tokens))
        families = [
            requests,
            counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                    lambda e: e.prompt_tokens),
            by_source,
            counter("vllm:prompt_tokens_cached",
                    "Number of cached prompt tokens (local + external).",
                    lambda e: e.prompt_tokens_cached),
            counter("vllm:generation_tokens", "Number of generation tokens processed.",
                    lambda e: e.generation_tokens),
            counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                    lambda e: e.num_preemptions),
            counter("vllm:prefix_cache_queries",
                    "Prefix cache queries, in terms of number of queried tokens.",
                    lambda e: e.prefix_cache_queries),
            counter("vllm:prefix_cache_hits",
                    "Prefix cache hits, in terms of number of cached tokens.",
                    lambda e: e.prefix_cache_hits),
        ]

        for e in engines:
            e.fold()
        for attr, name, doc, _ in _HISTOGRAMS:
            les = self._les[attr]
            histograms = HistogramMetricFamily(name, doc, labels=_LABELS)
            for e in engines:
                if attr == "inter_token_latency":
                    counts, total = list(e.itl_counts), e.itl_sum
                else:
                    histogram: _Histogram = getattr(e, attr)
                    counts, total = list(histogram.counts), histogram.sum
                # Cumulate (from the copy) as prometheus-client does, in floats.
                buckets = []
                cumulative = 0.0
                for le, count in zip(les, counts, strict=True):
                    cumulative += count
                    buckets.append((le, cumulative))
                histograms.add_metric(e.labels, buckets, total)
            families.append(histograms)

        by_reason = GaugeMetricFamily(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for "
            "scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, "
            "KV transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting.",
            labels=(*_LABELS, "reason"))
        for e in engines:
            by_reason.add_metric((*e.labels, "capacity"), e.gauge_waiting_capacity)
            by_reason.add_metric((*e.labels, "deferred"), e.gauge_waiting_deferred)
        families += [
            gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                  lambda e: e.gauge_running),
            gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                  lambda e: e.gauge_waiting),
            by_reason,
            gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                  lambda e: e.gauge_kv_cache_usage),
        ]
        return families


def _dz(end: float, start: float) -> float:
    """``end - start`` when both timestamps were seen (> 0) and ordered, else 0."""
    if start > 0.0 and end > 0.0 and end >= start:
        return end - start
    return 0.0
class Metrics:
    """vLLM's front-end Prometheus metrics for one client (one model name).

    ``registry=None`` creates a private :class:`CollectorRegistry` (never the global
    ``REGISTRY``); pass one to share it (two :class:`Metrics` on one registry clash:
    ``ValueError``). Expose it with ``prometheus_client.generate_latest(metrics.registry)``.

    Metric names, label names (``model_name``, ``engine``, then ``finished_reason`` /
    ``source`` / ``reason``), documentation and buckets are vLLM's, so dashboards for
    ``vllm serve`` work unchanged. Per-engine series appear (at zero) the first time an engine
    index is seen. The ``_created`` series are not exposed.
    """

    __slots__ = ("_engines", "_exposition", "_max_model_len", "_model_name", "_registry",
                 "_success_order", "_token_bounds")

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        model_name: str = "anyio-genout",
        max_model_len: int = 131072,
    ) -> None:
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1, got {max_model_len}")
        self._registry = CollectorRegistry() if registry is None else registry
        self._model_name = model_name
        self._max_model_len = max_model_len
        self._token_bounds = build_1_2_5_buckets(max_model_len)
        self._engines: dict[int, _EngineSeries] = {}
        self._success_order: list[tuple[_EngineSeries, str]] = []
        self._exposition = _Exposition(self._engines, self._token_bounds, self._success_order)
        self._registry.register(self._exposition)

    @property
    def registry(self) -> CollectorRegistry:
        """The registry the metrics are exposed through."""
        return self._registry

    @property
    def model_name(self) -> str:
        """The ``model_name`` label value."""
        return self._model_name

    @property
    def max_model_len(self) -> int:
        """The cap of the token-count histogram buckets."""
        return self._max_model_len

    @property
    def engine_indexes(self) -> tuple[int, ...]:
        """Engine indexes seen so far, in order of first appearance."""
        return tuple(self._engines)

    def unregister(self) -> None:
        """Remove the metrics from :attr:`registry` (useful with a shared registry)."""
        self._registry.unregister(self._exposition)

    def _engine(self, engine_index: int) -> _EngineSeries:
        series = self._engines.get(engine_index)
        if series is None:
            series = self._engines[engine_index] = _EngineSeries(
                str(self._model_name), engine_index, self._token_bounds, self._success_order)
        return series

    def tracker(
        self,
        *,
        engine_index: int,
        arrival_time: float,
        prompt_len: int,
        max_tokens: int | None,
    ) -> RequestTracker:
        """A tracker for one request sent to ``engine_index``.

        ``arrival_time`` is the front end's ``time.time()`` when the request arrived;
        ``max_tokens`` ``None`` skips ``vllm:request_params_max_tokens``.
        """
        return RequestTracker(self._engine(engine_index), arrival_time, prompt_len, max_tokens)

    def observe_scheduler_stats(self, engine_index: int, stats: SchedulerStats) -> None:
        """Record one engine step's scheduler statistics.

        Sets ``vllm:num_requests_running``, ``vllm:num_requests_waiting`` (capacity-waiting
        plus deferred), ``vllm:num_requests_waiting_by_reason`` and
        ``vllm:kv_cache_usage_perc``; adds the step's prefix-cache queries and hits (the engine
        sends per-step increments, not totals) to ``vllm:prefix_cache_queries`` /
        ``vllm:prefix_cache_hits``.
        """
        series = self._engine(engine_index)
        running = stats.num_running_reqs
        waiting = stats.num_waiting_reqs
        deferred = stats.num_skipped_waiting_reqs
        usage = stats.kv_cache_usage
        series.gauge_running = float(running)
        series.gauge_waiting = float(waiting + deferred)
        series.gauge_waiting_capacity = float(waiting)
        series.gauge_waiting_deferred = float(deferred)
        series.gauge_kv_cache_usage = float(usage)
        series.last_running = running
        series.last_waiting = waiting + deferred
        series.last_kv_cache_usage = usage
        series.has_scheduler_stats = True
        queries = stats.prefix_cache_queries
        if queries > 0:
            series.prefix_cache_queries += queries
        hits = stats.prefix_cache_hits
        if hits > 0:
            series.prefix_cache_hits += hits

    def snapshot(self) -> dict[int, EngineTotals]:
        """The running totals of every engine seen so far (cheap: no registry collection)."""
        return {index: series.totals() for index, series in self._engines.items()}


class RequestTracker:
    """One request's metric state; see the module docstring for what is recorded when.

    Create with :meth:`Metrics.tracker`. Feed every engine output for the request to
    :meth:`observe_output` and call :meth:`record_finished` once the request ends (a terminal
    output, an abort, or the stream being closed); do not call it when the request failed with
    an error rather than finishing.
    """

    __slots__ = (
        "_arrival_time", "_finished", "_first_token_latency", "_first_token_ts",
        "_last_token_ts", "_latest_num_cached_tokens", "_max_tokens",
        "_num_generation_tokens", "_num_preemptions", "_prompt_len", "_queued_ts",
        "_scheduled_ts", "_series", "is_prefilling",
    )

    def __init__(
        self,
        series: _EngineSeries,
        arrival_time: float,
        prompt_len: int,
        max_tokens: int | None,
    ) -> None:
        self._series = series
        self._arrival_time = arrival_time
        self._prompt_len = prompt_len
        self._max_tokens = max_tokens
        #: True until the first output carrying tokens (read-only; an attribute, not a
        #: property, because the generate stream reads it once per output).
        self.is_prefilling = True
        self._finished = False
        self._num_generation_tokens = 0
        self._num_preemptions = 0
        self._latest_num_cached_tokens = 0
        self._queued_ts = 0.0
        self._scheduled_ts = 0.0
        self._first_token_ts = 0.0
        self._last_token_ts = 0.0
        self._first_token_latency = 0.0

    # ------------------------------------------------------------------ read-only state

    @property
    def engine_index(self) -> int:
        return self._series.engine_index

    @property
    def arrival_time(self) -> float:
        """Front-end wall clock (``time.time()``) when the request arrived."""
        return self._arrival_time

    @property
    def prompt_len(self) -> int:
        return self._prompt_len

    @property
    def max_tokens(self) -> int | None:
        return self._max_tokens

    @property
    def finished(self) -> bool:
        """True once :meth:`record_finished` has run."""
        return self._finished

    @property
    def num_generation_tokens(self) -> int:
        return self._num_generation_tokens

    @property
    def num_preemptions(self) -> int:
        return self._num_preemptions

    @property
    def latest_num_cached_tokens(self) -> int:
        """``num_cached_tokens`` of the latest output carrying ``prefill_stats``."""
        return self._latest_num_cached_tokens

    @property
    def queued_ts(self) -> float:
        """Engine monotonic time of the last QUEUED event (0 if none)."""
        return self._queued_ts

    @property
    def scheduled_ts(self) -> float:
        """Engine monotonic time of the first SCHEDULED event (0 if none)."""
        return self._scheduled_ts

    @property
    def first_token_ts(self) -> float:
        """Engine batch timestamp of the first token-bearing output (0 if none)."""
        return self._first_token_ts

    @property
    def last_token_ts(self) -> float:
        """Engine batch timestamp of the latest token-bearing output (0 if none)."""
        return self._last_token_ts

    @property
    def first_token_latency(self) -> float:
        """Front-end TTFT in seconds: first token's ``received_at - arrival_time`` (0 before)."""
        return self._first_token_latency

    # ------------------------------------------------------------------ recording

    def observe_output(
        self, batch_timestamp: float, received_at: float, output: EngineCoreOutput
    ) -> None:
        """Fold in one output of this request.

        ``batch_timestamp`` is the carrying ``EngineCoreOutputs.timestamp`` (engine monotonic
        clock); ``received_at`` the front end's ``time.time()`` when the batch arrived. Outputs
        without tokens (finish-only, synthetic abort) record neither TTFT nor ITL.
        """
        # The hot path: a decode output (tokens, no prefill stats, no events) costs a few
        # attribute updates and at most one bisect; keep it that way.
        prefill = output.prefill_stats
        if prefill is not None:
            self._latest_num_cached_tokens = prefill.num_cached_tokens
        events = output.events
        if events:
            self._observe_events(events)
        n = len(output.new_token_ids)
        if n:
            series = self._series
            self._num_generation_tokens += n
            series.generation_tokens += n
            last = self._last_token_ts
            if last > 0.0:  # so not prefilling: the first token-bearing output sets it
                # _Histogram.observe of vllm:inter_token_latency_seconds, inlined, with the
                # bucket of the previous value remembered: the outputs of one engine step
                # usually share both batch timestamps, so the bisect runs once per step.
                itl = batch_timestamp - last
                if itl == series.itl_last:
                    series.itl_counts[series.itl_last_bucket] += 1
                else:
                    i = bisect_left(_ITL_BOUNDS, itl)
                    if i or itl == itl:
                        series.itl_counts[i] += 1
                    series.itl_last = itl
                    series.itl_last_bucket = i
                series.itl_sum += itl
            elif self.is_prefilling:
                self._observe_first_token(batch_timestamp, received_at, prefill)
            self._last_token_ts = batch_timestamp

    def _observe_events(self, events: Sequence[EngineCoreEvent]) -> None:
        for event in events:
            kind = event.type
            if kind == _QUEUED:
                self._queued_ts = event.timestamp
            elif kind == _SCHEDULED:
                if self._scheduled_ts == 0.0:
                    self._scheduled_ts = event.timestamp
            elif kind == _PREEMPTED:
                self._num_preemptions += 1
                self._series.num_preemptions += 1

    def _observe_first_token(self, batch_timestamp: float, received_at: float,
                             prefill: PrefillStats | None) -> None:
        series = self._series
        if prefill is not None:
            series.record_prompt(prefill)
        latency = received_at - self._arrival_time
        self._first_token_latency = latency
        series.time_to_first_token.observe(latency)
        self._first_token_ts = batch_timestamp
        self.is_prefilling = False

    def record_finished(self, received_at: float, reason: str | EngineCoreFinishReason) -> None:
        """Record the request's end: ``vllm:request_success`` and the per-request histograms.

        ``received_at`` is the front end's ``time.time()`` when the end was observed; ``reason``
        the ``finished_reason`` label (``"stop"``, ``"length"``, ``"abort"``, ``"error"``,
        ``"repetition"``; an :class:`EngineCoreFinishReason` is converted). Idempotent: only
        the first call records anything.
        """
        if self._finished:
            return
        self._finished = True
        if not isinstance(reason, str):
            reason = finish_reason_label(reason)
        series = self._series
        queued, scheduled = self._queued_ts, self._scheduled_ts
        first, last = self._first_token_ts, self._last_token_ts
        n_gen = self._num_generation_tokens
        decode = _dz(last, first)
        series.count_success(reason)
        # The values of _FINISH_COLUMNS, in order; folded into the histograms in batches.
        finished = series.finished
        finished.append((
            received_at - self._arrival_time,
            _dz(scheduled, queued),
            _dz(first, scheduled),
            decode,
            _dz(last, scheduled),
            decode / (n_gen - 1) if n_gen > 1 else 0.0,
            self._prompt_len,
            n_gen,
            n_gen,
            math.nan if self._max_tokens is None else self._max_tokens,
            1,
            max(0, self._prompt_len - self._latest_num_cached_tokens),
            self._num_preemptions,
        ))
        if len(finished) >= _FOLD_AT:
            series.fold(wait=False)
