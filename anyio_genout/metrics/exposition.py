"""The one collector of a :class:`~.core.Metrics`: every metric family, built at scrape time.

The families have vLLM's names, documentation, labels and buckets, and the values, sample
order and ``le`` strings that prometheus-client's own ``Counter`` / ``Gauge`` / ``Histogram``
children would produce, minus the ``_created`` series.

Threads: a scrape may run on another thread than the event loop's
(``prometheus_client.start_http_server``). The collector copies what it reads (the engine
dict, the bucket counts) before iterating, so a concurrent scrape never fails; it may see an
update half applied (a histogram's ``_sum`` one observation ahead of its buckets), which the
next scrape corrects.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Final

from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from .buckets import (
    INTER_TOKEN_LATENCY_BUCKETS,
    ITERATION_TOKENS_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    REQUEST_NUM_PREEMPTIONS_BUCKETS,
    REQUEST_PARAMS_N_BUCKETS,
    TIME_TO_FIRST_TOKEN_BUCKETS,
)
from .histogram import Histogram
from .labels import LABELS, PROMPT_TOKEN_SOURCES, WAITING_REASONS
from .series import EngineSeries
from .steps import SleepState, step_families

__all__ = ["Exposition"]

_TOKENS: Final = None  # marks the token-count histograms, bounded by ``max_model_len``


# The histograms in exposition order: (attribute of EngineSeries, name, documentation, bounds);
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



class Exposition:
    """The one collector registered for a :class:`Metrics`: builds every family at scrape time.

    The samples are what prometheus-client's ``Counter`` / ``Gauge`` / ``Histogram`` children
    (created per engine in order of first appearance, request-success reasons in order of
    first use) would expose, as floats, without the ``_created`` series. ``describe`` (the
    families without samples) lets the registry detect name clashes without collecting.
    """

    __slots__ = ("_engines", "_iteration_les", "_les", "_migrations", "_model_name", "_sleep",
                 "_success_order", "_up")

    def __init__(self, engines: dict[int, EngineSeries], token_bounds: tuple[float, ...],
                 success_order: list[tuple[EngineSeries, str]],
                 up: dict[int, float] | None = None, model_name: str = "",
                 migrations: dict[int, int] | None = None,
                 sleep: SleepState | None = None) -> None:
        self._engines = engines
        self._sleep = SleepState() if sleep is None else sleep
        self._iteration_les = (*map(floatToGoString, ITERATION_TOKENS_BUCKETS), "+Inf")
        self._success_order = success_order
        self._up = {} if up is None else up
        self._migrations = {} if migrations is None else migrations
        self._model_name = model_name
        # The ``le`` label values of each histogram, formatted as prometheus-client does.
        self._les: dict[str, tuple[str, ...]] = {
            attr: (*map(floatToGoString, token_bounds if bounds is None else bounds), "+Inf")
            for attr, _, _, bounds in _HISTOGRAMS
        }

    def describe(self) -> list[Metric]:
        return [*self._families((), ()),
                *step_families((), self._sleep, self._model_name, self._iteration_les,
                               describe=True),
                self._engine_up(()), self._request_migrations(())]

    def collect(self) -> Iterator[Metric]:
        # Copies first: the event loop may add an engine or a reason meanwhile.
        engines = tuple(self._engines.values())
        yield from self._families(engines, tuple(self._success_order))
        yield from step_families([(e.labels, e.steps) for e in engines], self._sleep,
                                 self._model_name, self._iteration_les)
        yield self._engine_up(tuple(self._up.items()))
        yield self._request_migrations(tuple(self._migrations.items()))

    def _request_migrations(self, counts: Sequence[tuple[int, int]]) -> Metric:
        """Our own family (not vLLM's): requests moved off each engine that died."""
        family = CounterMetricFamily(
            "anyio_genout:request_migrations",
            "Requests resubmitted to a live engine after this engine died "
            "(ClientConfig.migration_limit).",
            labels=LABELS)
        for index, count in counts:
            family.add_metric((self._model_name, str(index)), float(count))
        return family

    def _engine_up(self, up: Sequence[tuple[int, float]]) -> Metric:
        """Our own family (not vLLM's): 1 per engine up, 0 per engine down."""
        family = GaugeMetricFamily(
            "anyio_genout:engine_up",
            "Whether the engine is up (1) or found dead (0), as the client sees it.",
            labels=LABELS)
        for index, value in up:
            family.add_metric((self._model_name, str(index)), value)
        return family

    def _families(self, engines: Sequence[EngineSeries],
                  success: Sequence[tuple[EngineSeries, str]]) -> list[Metric]:
        """Every family, in exposition order (counters, histograms, gauges)."""

        def counter(name: str, doc: str, get: Callable[[EngineSeries], int]) -> Metric:
            family = CounterMetricFamily(name, doc, labels=LABELS)
            for e in engines:
                family.add_metric(e.labels, float(get(e)))
            return family

        def gauge(name: str, doc: str, get: Callable[[EngineSeries], float]) -> Metric:
            family = GaugeMetricFamily(name, doc, labels=LABELS)
            for e in engines:
                family.add_metric(e.labels, get(e))
            return family

        requests = CounterMetricFamily(
            "vllm:request_success", "Count of successfully processed requests.",
            labels=(*LABELS, "finished_reason"))
        for e, reason in success:
            requests.add_metric((*e.labels, reason), float(e.success.get(reason, 0)))
        by_source = CounterMetricFamily(
            "vllm:prompt_tokens_by_source", "Number of prompt tokens by source.",
            labels=(*LABELS, "source"))
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
            histograms = HistogramMetricFamily(name, doc, labels=LABELS)
            for e in engines:
                if attr == "inter_token_latency":
                    counts, total = list(e.itl_counts), e.itl_sum
                else:
                    histogram: Histogram = getattr(e, attr)
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
            labels=(*LABELS, "reason"))
        for e in engines:
            for reason, waiting in zip(WAITING_REASONS, (
                    e.gauge_waiting_capacity, e.gauge_waiting_deferred), strict=True):
                by_reason.add_metric((*e.labels, reason), waiting)
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
