"""Prometheus metrics with vLLM's names, labels and buckets, recorded by the client.

:class:`Metrics` owns every metric family (in a private :class:`CollectorRegistry` unless one is
given) and, per engine index, the pre-labelled children (:class:`_EngineSeries`). Each request
gets a :class:`RequestTracker` that folds the engine's outputs into timing state and records:

* per output (hot path): ``vllm:generation_tokens``, ``vllm:num_preemptions``, prompt-token
  counters and TTFT on the first token-bearing output, ITL on later ones;
* once, at the end (:meth:`RequestTracker.record_finished`): ``vllm:request_success`` and the
  per-request histograms.

Clocks (never mixed): ``arrival_time`` and ``received_at`` are the front end's ``time.time()``
(only TTFT and end-to-end latency use them); the batch timestamps and event timestamps are the
engine's ``time.monotonic()`` (ITL and the phase times).

Scheduler statistics (:meth:`Metrics.observe_scheduler_stats`) set the per-engine gauges and
add the step's prefix-cache increments. Alongside the Prometheus children, :class:`Metrics`
keeps plain running totals per engine (:meth:`Metrics.snapshot`) for the periodic logger.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Final

import attrs
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric

from ..protocol.outputs import (
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


class _Families:
    """The metric families (unlabelled parents), created outside any registry."""

    __slots__ = (
        "decode_time",
        "e2e_request_latency",
        "generation_tokens",
        "inference_time",
        "inter_token_latency",
        "kv_cache_usage_perc",
        "num_preemptions",
        "num_requests_running",
        "num_requests_waiting",
        "num_requests_waiting_by_reason",
        "prefill_time",
        "prefix_cache_hits",
        "prefix_cache_queries",
        "prompt_tokens",
        "prompt_tokens_by_source",
        "prompt_tokens_cached",
        "queue_time",
        "request_generation_tokens",
        "request_max_num_generation_tokens",
        "request_num_preemptions",
        "request_params_max_tokens",
        "request_params_n",
        "request_prefill_kv_computed_tokens",
        "request_prompt_tokens",
        "request_success",
        "time_per_output_token",
        "time_to_first_token",
    )

    def __init__(self, max_model_len: int) -> None:
        def counter(name: str, doc: str, *extra: str) -> Counter:
            return Counter(name, doc, (*_LABELS, *extra), registry=None)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(name, doc, _LABELS, registry=None, buckets=buckets)

        def gauge(name: str, doc: str, *extra: str) -> Gauge:
            return Gauge(name, doc, (*_LABELS, *extra), registry=None,
                         multiprocess_mode="mostrecent")

        tokens = build_1_2_5_buckets(max_model_len)
        self.request_success = counter(
            "vllm:request_success", "Count of successfully processed requests.",
            "finished_reason")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.prompt_tokens_by_source = counter(
            "vllm:prompt_tokens_by_source", "Number of prompt tokens by source.", "source")
        self.prompt_tokens_cached = counter(
            "vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external).")
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed.")
        self.num_preemptions = counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prefix_cache_queries = counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_cache_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.time_to_first_token = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
            TIME_TO_FIRST_TOKEN_BUCKETS)
        self.inter_token_latency = histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
            INTER_TOKEN_LATENCY_BUCKETS)
        self.e2e_request_latency = histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS)
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.inference_time = histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.prefill_time = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS)
        self.decode_time = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS)
        self.time_per_output_token = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            INTER_TOKEN_LATENCY_BUCKETS)
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens)
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", tokens)
        self.request_max_num_generation_tokens = histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.", tokens)
        self.request_params_max_tokens = histogram(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.",
            tokens)
        self.request_params_n = histogram(
            "vllm:request_params_n", "Histogram of the n request parameter.",
            REQUEST_PARAMS_N_BUCKETS)
        self.request_num_preemptions = histogram(
            "vllm:request_num_preemptions",
            "Histogram of the number of times a request was preempted.",
            REQUEST_NUM_PREEMPTIONS_BUCKETS)
        self.request_prefill_kv_computed_tokens = histogram(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            tokens)
        self.num_requests_running = gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches.")
        self.num_requests_waiting = gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.num_requests_waiting_by_reason = gauge(
            "vllm:num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for "
            "scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, "
            "KV transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting.",
            "reason")
        self.kv_cache_usage_perc = gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")

    def all(self) -> list[Counter | Gauge | Histogram]:
        """Every family, in exposition order (counters, histograms, gauges)."""
        return [
            self.request_success, self.prompt_tokens, self.prompt_tokens_by_source,
            self.prompt_tokens_cached, self.generation_tokens, self.num_preemptions,
            self.prefix_cache_queries, self.prefix_cache_hits,
            self.time_to_first_token, self.inter_token_latency, self.e2e_request_latency,
            self.queue_time, self.inference_time, self.prefill_time, self.decode_time,
            self.time_per_output_token, self.request_prompt_tokens,
            self.request_generation_tokens, self.request_max_num_generation_tokens,
            self.request_params_max_tokens, self.request_params_n, self.request_num_preemptions,
            self.request_prefill_kv_computed_tokens,
            self.num_requests_running, self.num_requests_waiting,
            self.num_requests_waiting_by_reason, self.kv_cache_usage_perc,
        ]


class _Exposition:
    """The one collector registered for a :class:`Metrics`: every family minus ``_created``.

    prometheus-client can only drop the ``_created`` series process-wide
    (``disable_created_metrics``), so the samples are filtered here, at scrape time, instead.
    ``describe`` lets the registry detect name clashes without collecting.
    """

    __slots__ = ("_families",)

    def __init__(self, families: Sequence[Counter | Gauge | Histogram]) -> None:
        self._families = tuple(families)

    def describe(self) -> list[Metric]:
        return [metric for family in self._families for metric in family.describe()]

    def collect(self) -> Iterator[Metric]:
        for family in self._families:
            for metric in family.collect():
                created = metric.name + "_created"
                metric.samples = [s for s in metric.samples if s.name != created]
                yield metric


class _EngineSeries:
    """One engine's labelled children (resolved once) and the running totals for the logger."""

    __slots__ = (
        "_labels",
        "_success",
        "_success_family",
        "decode_time",
        "e2e_request_latency",
        "engine_index",
        "generation_tokens",
        "has_scheduler_stats",
        "inference_time",
        "inter_token_latency",
        "kv_cache_usage_perc",
        "last_kv_cache_usage",
        "last_running",
        "last_waiting",
        "num_preemptions",
        "num_requests_running",
        "num_requests_waiting",
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
        "time_per_output_token",
        "time_to_first_token",
        "total_computed_prompt_tokens",
        "total_generation_tokens",
        "total_prefix_cache_hits",
        "total_prefix_cache_queries",
        "waiting_capacity",
        "waiting_deferred",
    )

    def __init__(self, families: _Families, model_name: str, engine_index: int) -> None:
        labels = (model_name, str(engine_index))
        self.engine_index = engine_index
        self._labels = labels
        self._success_family = families.request_success
        self._success: dict[str, Counter] = {
            reason: families.request_success.labels(*labels, reason)
            for reason in FINISHED_REASONS
        }
        by_source = families.prompt_tokens_by_source
        self.prompt_local_compute: Counter = by_source.labels(*labels, "local_compute")
        self.prompt_local_cache_hit: Counter = by_source.labels(*labels, "local_cache_hit")
        self.prompt_external_kv_transfer: Counter = by_source.labels(
            *labels, "external_kv_transfer")
        self.generation_tokens: Counter = families.generation_tokens.labels(*labels)
        self.num_preemptions: Counter = families.num_preemptions.labels(*labels)
        self.prompt_tokens: Counter = families.prompt_tokens.labels(*labels)
        self.prompt_tokens_cached: Counter = families.prompt_tokens_cached.labels(*labels)
        self.prefix_cache_queries: Counter = families.prefix_cache_queries.labels(*labels)
        self.prefix_cache_hits: Counter = families.prefix_cache_hits.labels(*labels)
        self.time_to_first_token: Histogram = families.time_to_first_token.labels(*labels)
        self.inter_token_latency: Histogram = families.inter_token_latency.labels(*labels)
        self.e2e_request_latency: Histogram = families.e2e_request_latency.labels(*labels)
        self.queue_time: Histogram = families.queue_time.labels(*labels)
        self.inference_time: Histogram = families.inference_time.labels(*labels)
        self.prefill_time: Histogram = families.prefill_time.labels(*labels)
        self.decode_time: Histogram = families.decode_time.labels(*labels)
        self.time_per_output_token: Histogram = families.time_per_output_token.labels(*labels)
        self.request_prompt_tokens: Histogram = families.request_prompt_tokens.labels(*labels)
        self.request_generation_tokens: Histogram = \
            families.request_generation_tokens.labels(*labels)
        self.request_max_num_generation_tokens: Histogram = \
            families.request_max_num_generation_tokens.labels(*labels)
        self.request_params_max_tokens: Histogram = \
            families.request_params_max_tokens.labels(*labels)
        self.request_params_n: Histogram = families.request_params_n.labels(*labels)
        self.request_num_preemptions: Histogram = \
            families.request_num_preemptions.labels(*labels)
        self.request_prefill_kv_computed_tokens: Histogram = \
            families.request_prefill_kv_computed_tokens.labels(*labels)
        self.num_requests_running: Gauge = families.num_requests_running.labels(*labels)
        self.num_requests_waiting: Gauge = families.num_requests_waiting.labels(*labels)
        by_reason = families.num_requests_waiting_by_reason
        self.waiting_capacity: Gauge = by_reason.labels(*labels, "capacity")
        self.waiting_deferred: Gauge = by_reason.labels(*labels, "deferred")
        self.kv_cache_usage_perc: Gauge = families.kv_cache_usage_perc.labels(*labels)
        self.total_computed_prompt_tokens = 0
        self.total_generation_tokens = 0
        self.total_prefix_cache_queries = 0
        self.total_prefix_cache_hits = 0
        self.last_running = 0
        self.last_waiting = 0
        self.last_kv_cache_usage = 0.0
        self.has_scheduler_stats = False

    def success(self, reason: str) -> Counter:
        """The ``vllm:request_success`` child for ``reason`` (unknown reasons get a new one)."""
        child = self._success.get(reason)
        if child is None:
            child = self._success[reason] = self._success_family.labels(*self._labels, reason)
        return child

    def record_prompt(self, stats: PrefillStats) -> None:
        """Prompt-token counters from a request's first token-bearing output."""
        if stats.num_prompt_tokens > 0:
            self.prompt_tokens.inc(stats.num_prompt_tokens)
        computed = stats.num_computed_tokens
        if computed > 0:
            self.prompt_local_compute.inc(computed)
            self.total_computed_prompt_tokens += computed
        if stats.num_local_cached_tokens > 0:
            self.prompt_local_cache_hit.inc(stats.num_local_cached_tokens)
        if stats.num_external_cached_tokens > 0:
            self.prompt_external_kv_transfer.inc(stats.num_external_cached_tokens)
        if stats.num_cached_tokens > 0:
            self.prompt_tokens_cached.inc(stats.num_cached_tokens)

    def totals(self) -> EngineTotals:
        return EngineTotals(
            self.engine_index,
            self.total_computed_prompt_tokens,
            self.total_generation_tokens,
            self.total_prefix_cache_queries,
            self.total_prefix_cache_hits,
            self.last_running,
            self.last_waiting,
            self.last_kv_cache_usage,
            self.has_scheduler_stats,
        )


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

    __slots__ = ("_engines", "_exposition", "_families", "_max_model_len", "_model_name",
                 "_registry")

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
        self._families = _Families(max_model_len)
        self._engines: dict[int, _EngineSeries] = {}
        self._exposition = _Exposition(self._families.all())
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
                self._families, self._model_name, engine_index)
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
        series.num_requests_running.set(running)
        series.num_requests_waiting.set(waiting + deferred)
        series.waiting_capacity.set(waiting)
        series.waiting_deferred.set(deferred)
        series.kv_cache_usage_perc.set(usage)
        series.last_running = running
        series.last_waiting = waiting + deferred
        series.last_kv_cache_usage = usage
        series.has_scheduler_stats = True
        queries = stats.prefix_cache_queries
        if queries > 0:
            series.prefix_cache_queries.inc(queries)
            series.total_prefix_cache_queries += queries
        hits = stats.prefix_cache_hits
        if hits > 0:
            series.prefix_cache_hits.inc(hits)
            series.total_prefix_cache_hits += hits

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
        "_is_prefilling", "_last_token_ts", "_latest_num_cached_tokens", "_max_tokens",
        "_num_generation_tokens", "_num_preemptions", "_prompt_len", "_queued_ts",
        "_scheduled_ts", "_series",
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
        self._is_prefilling = True
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
    def is_prefilling(self) -> bool:
        """True until the first output carrying tokens."""
        return self._is_prefilling

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
        prefill = output.prefill_stats
        if prefill is not None:
            self._latest_num_cached_tokens = prefill.num_cached_tokens
        events = output.events
        if events:
            for event in events:
                kind = event.type
                if kind == _QUEUED:
                    self._queued_ts = event.timestamp
                elif kind == _SCHEDULED:
                    if self._scheduled_ts == 0.0:
                        self._scheduled_ts = event.timestamp
                elif kind == _PREEMPTED:
                    self._num_preemptions += 1
                    self._series.num_preemptions.inc()
        n = len(output.new_token_ids)
        if n:
            series = self._series
            self._num_generation_tokens += n
            series.generation_tokens.inc(n)
            series.total_generation_tokens += n
            if self._is_prefilling:
                if prefill is not None:
                    series.record_prompt(prefill)
                latency = received_at - self._arrival_time
                self._first_token_latency = latency
                series.time_to_first_token.observe(latency)
                self._first_token_ts = batch_timestamp
                self._is_prefilling = False
            elif self._last_token_ts > 0.0:
                series.inter_token_latency.observe(batch_timestamp - self._last_token_ts)
            self._last_token_ts = batch_timestamp

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
        series.success(reason).inc()
        series.e2e_request_latency.observe(received_at - self._arrival_time)
        series.queue_time.observe(_dz(scheduled, queued))
        series.prefill_time.observe(_dz(first, scheduled))
        series.decode_time.observe(decode)
        series.inference_time.observe(_dz(last, scheduled))
        series.time_per_output_token.observe(decode / (n_gen - 1) if n_gen > 1 else 0.0)
        series.request_prompt_tokens.observe(self._prompt_len)
        series.request_generation_tokens.observe(n_gen)
        series.request_max_num_generation_tokens.observe(n_gen)
        if self._max_tokens is not None:
            series.request_params_max_tokens.observe(self._max_tokens)
        series.request_params_n.observe(1)
        series.request_prefill_kv_computed_tokens.observe(
            max(0, self._prompt_len - self._latest_num_cached_tokens))
        series.request_num_preemptions.observe(self._num_preemptions)
