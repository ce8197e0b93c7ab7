"""``HttpMetrics``: the HTTP families ``vllm serve`` exposes, recorded by a pure ASGI middleware.

``vllm serve`` instruments its app with prometheus-fastapi-instrumentator's default metrics
(``Instrumentator(excluded_handlers=[...]).add().instrument(app)``); these are the same
families, names, help texts, label names and buckets:

* ``http_requests_total`` (counter; ``method``, ``status``, ``handler``);
* ``http_request_size_bytes`` / ``http_response_size_bytes`` (summaries; ``handler``): the
  request's and the response's ``Content-Length`` header (0 without one: a streamed
  response counts 0, as there);
* ``http_request_duration_highr_seconds`` (histogram, no labels, many buckets);
* ``http_request_duration_seconds`` (histogram; ``method``, ``handler``; 0.1, 0.5, 1).

``handler`` is the route's path template (``/v1/completions``; a path whose method is not
allowed still names its route), else ``none``; ``status`` is grouped (``2xx``, ``4xx``, ...;
``5xx`` when no response was started). Requests whose handler (or raw path) contains
``/metrics``, ``/health``, ``/load``, ``/ping``, ``/version`` or ``/server_info`` are not
recorded, as vLLM excludes them. The duration runs from the request's arrival at the
middleware to the end of its response, a whole stream included, or to the request's end
however it ends (client gone, cancelled).

The instrumentator itself is not used: it awaits ``asyncio.gather()`` on every request,
which needs an asyncio event loop (on trio it would create one), and it builds a starlette
``Response`` per request. Recording here touches plain numbers; the families are built at
scrape time by one collector per registry (:func:`http_series`), shared by every app on it.
"""

from __future__ import annotations

import re
import time
import weakref
from collections.abc import Iterator, Sequence
from typing import Any, Final

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    HistogramMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.utils import floatToGoString
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..metrics.buckets import HTTP_DURATION_BUCKETS, HTTP_DURATION_HIGHR_BUCKETS
from ..metrics.histogram import Histogram

__all__ = ["EXCLUDED_HANDLERS", "HttpMetrics", "HttpSeries", "client_http_series",
           "http_series"]

#: vLLM's ``excluded_handlers`` (regular expressions searched in the handler).
EXCLUDED_HANDLERS: Final = ("/metrics", "/health", "/load", "/ping", "/version",
                            "/server_info")
_EXCLUDED: Final = tuple(re.compile(pattern) for pattern in EXCLUDED_HANDLERS)
_SIZE_DOC: Final = ("Content length of {} by handler. Only value of header is respected. "
                    "Otherwise ignored. No percentile calculated. ")


class HttpSeries:
    """The recorded HTTP values of one registry, and the collector exposing them.

    Threads: the event loop records; a scrape may run on another thread and copies what it
    reads first (a scrape may see a request half recorded, which the next one corrects).
    """

    __slots__ = ("_highr_les", "_lowr_les", "highr", "lowr", "request_size", "requests",
                 "response_size")

    def __init__(self) -> None:
        #: ``http_requests_total`` by ``(method, status, handler)``.
        self.requests: dict[tuple[str, str, str], int] = {}
        #: ``[count, sum]`` by handler.
        self.request_size: dict[str, list[float]] = {}
        self.response_size: dict[str, list[float]] = {}
        self.highr = Histogram(HTTP_DURATION_HIGHR_BUCKETS)
        #: ``http_request_duration_seconds`` by ``(method, handler)``.
        self.lowr: dict[tuple[str, str], Histogram] = {}
        self._highr_les = (*map(floatToGoString, HTTP_DURATION_HIGHR_BUCKETS), "+Inf")
        self._lowr_les = (*map(floatToGoString, HTTP_DURATION_BUCKETS), "+Inf")

    def record(self, method: str, status: str, handler: str, duration: float,
               request_size: int, response_size: int) -> None:
        """One request's end (``status`` already grouped, e.g. ``"2xx"``)."""
        key = (method, status, handler)
        self.requests[key] = self.requests.get(key, 0) + 1
        for sizes, size in ((self.request_size, request_size),
                            (self.response_size, response_size)):
            entry = sizes.get(handler)
            if entry is None:
                sizes[handler] = [1.0, float(size)]
            else:
                entry[0] += 1.0
                entry[1] += size
        self.highr.observe(duration)
        lowr = self.lowr.get((method, handler))
        if lowr is None:
            lowr = self.lowr[method, handler] = Histogram(HTTP_DURATION_BUCKETS)
        lowr.observe(duration)

    def describe(self) -> list[Metric]:
        return self._families((), (), (), (), ())

    def collect(self) -> Iterator[Metric]:
        yield from self._families(
            tuple(self.requests.items()),
            tuple((h, tuple(v)) for h, v in tuple(self.request_size.items())),
            tuple((h, tuple(v)) for h, v in tuple(self.response_size.items())),
            ((list(self.highr.counts), self.highr.sum),),
            tuple((key, (list(h.counts), h.sum)) for key, h in tuple(self.lowr.items())))

    def _families(self, requests: Sequence[tuple[tuple[str, str, str], int]],
                  in_size: Sequence[tuple[str, Sequence[float]]],
                  out_size: Sequence[tuple[str, Sequence[float]]],
                  highr: Sequence[tuple[list[int], float]],
                  lowr: Sequence[tuple[tuple[str, str], tuple[list[int], float]]],
                  ) -> list[Metric]:
        total = CounterMetricFamily(
            "http_requests", "Total number of requests by method, status and handler.",
            labels=("method", "status", "handler"))
        for key, count in requests:
            total.add_metric(key, float(count))
        sizes = []
        for name, what, values in (("http_request_size_bytes", "incoming requests", in_size),
                                   ("http_response_size_bytes", "outgoing responses",
                                    out_size)):
            summary = SummaryMetricFamily(name, _SIZE_DOC.format(what), labels=("handler",))
            for handler, (observed, size_sum) in values:
                summary.add_metric((handler,), int(observed), size_sum)
            sizes.append(summary)
        many = HistogramMetricFamily(
            "http_request_duration_highr_seconds",
            "Latency with many buckets but no API specific labels. Made for more accurate "
            "percentile calculations. ")
        for counts, duration_sum in highr:
            many.add_metric((), _cumulate(self._highr_les, counts), duration_sum)
        few = HistogramMetricFamily(
            "http_request_duration_seconds",
            "Latency with only few buckets by handler. Made to be only used if aggregation "
            "by handler is important. ", labels=("method", "handler"))
        for pair, (counts, duration_sum) in lowr:
            few.add_metric(pair, _cumulate(self._lowr_les, counts), duration_sum)
        return [total, *sizes, many, few]


def _cumulate(les: tuple[str, ...], counts: list[int]) -> list[tuple[str, float]]:
    buckets, cumulative = [], 0.0
    for le, count in zip(les, counts, strict=True):
        cumulative += count
        buckets.append((le, cumulative))
    return buckets


_SERIES: weakref.WeakKeyDictionary[CollectorRegistry, HttpSeries] = weakref.WeakKeyDictionary()


def http_series(registry: CollectorRegistry) -> HttpSeries:
    """The HTTP series of ``registry``, registered there the first time.

    Raises prometheus-client's ``ValueError`` (duplicated timeseries) if ``registry`` already
    holds families of these names from elsewhere (e.g. an instrumentator of its own).
    """
    series = _SERIES.get(registry)
    if series is None:
        series = HttpSeries()
        registry.register(series)
        _SERIES[registry] = series
    return series


def client_http_series(client: object) -> HttpSeries:
    """:func:`http_series` of ``client.metrics.registry`` (a :class:`~anyio_genout.Client`'s);
    an object without one (an app built only for its OpenAPI schema) gets series of its own,
    registered nowhere. Raises what :func:`http_series` raises."""
    registry = getattr(getattr(client, "metrics", None), "registry", None)
    return http_series(registry) if isinstance(registry, CollectorRegistry) else HttpSeries()


def _route_path(scope: Scope) -> str | None:
    """The path template of the route that served ``scope`` (FastAPI puts it in the scope
    once routed), else the first route matching it, fully or by path only (the router has
    not run: the request was answered before it)."""
    path = getattr(scope.get("route"), "path", None)
    if isinstance(path, str):
        return path
    partial: str | None = None
    for route in _routes(getattr(scope.get("app"), "routes", None) or ()):
        match, _ = route.matches(scope)
        path = getattr(route, "path", None)
        if match is Match.NONE or not isinstance(path, str):
            continue
        if match is Match.FULL:
            return path
        if partial is None:
            partial = path
    return partial


def _routes(routes: Sequence[Any]) -> Iterator[Any]:
    """``routes``, with FastAPI's included routers (which match nothing themselves) replaced
    by the routes they hold."""
    for route in routes:
        contexts = getattr(route, "effective_route_contexts", None)
        if callable(contexts):
            for context in contexts():
                yield getattr(context, "starlette_route", None) or context
        else:
            yield route


def _content_length(headers: Sequence[tuple[bytes, bytes]]) -> int:
    for name, value in headers:
        if name.lower() == b"content-length":
            return int(value) if value.isdigit() else 0
    return 0


class HttpMetrics:
    """Record every HTTP request (but the excluded handlers) in ``series``."""

    def __init__(self, app: ASGIApp, *, series: HttpSeries) -> None:
        self._app = app
        self._series = series

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500
        response_size = 0

        async def send_recording(message: Message) -> None:
            nonlocal status, response_size
            if message["type"] == "http.response.start":
                status = message["status"]
                response_size = _content_length(message.get("headers", ()))
            await send(message)

        try:
            await self._app(scope, receive, send_recording)
        finally:
            route = _route_path(scope)
            handler = scope["path"] if route is None else route
            if not any(pattern.search(handler) for pattern in _EXCLUDED):
                self._series.record(
                    scope["method"], f"{str(status)[0]}xx", "none" if route is None else route,
                    max(time.perf_counter() - start, 0.0),
                    _content_length(scope.get("headers", ())), response_size)
