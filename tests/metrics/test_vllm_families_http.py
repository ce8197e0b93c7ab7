"""vLLM 0.32's families beyond the first 27 and the HTTP families, scraped from ``/metrics``
through real HTTP after a workload on the mock engine, checked against what it did."""

from __future__ import annotations

import json
from typing import Any

import anyio
import httpx
import msgpack
import pytest
from prometheus_client.parser import text_string_to_metric_families

from anyio_genout.mock import step as mock_step
from tests.server.support import MODEL, Served, served

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

PROMPT = "Once upon a time there was a lighthouse keeper who"


def scrape_text(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


async def scrape(http: httpx.AsyncClient, s: Served) -> dict[tuple[str, frozenset[tuple[
        str, str]]], float]:
    response = await http.get(f"{s.base_url}/metrics")
    assert response.status_code == 200
    return scrape_text(response.text)


def at(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str,
       **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def engine(s: Served, **extra: str) -> dict[str, str]:
    """Engine 0's labels: the client's ``model_name`` (``ClientConfig.model_name``, which
    ``anyio-genout serve`` sets to the served name: tests/server/test_served_name_metrics)."""
    return {"model_name": s.setup.text.client.metrics.model_name, "engine": "0", **extra}


async def complete(http: httpx.AsyncClient, s: Served, max_tokens: int,
                   prompt: str = PROMPT) -> dict[str, Any]:
    response = await http.post(f"{s.v1}/completions", json={
        "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0})
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


async def settled(http: httpx.AsyncClient, s: Served, name: str, labels: dict[str, str],
                  expected: float) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Scrape until ``name{labels}`` reads ``expected`` (the engine's last statistics may
    arrive just after the last response), 5 s at most."""
    with anyio.fail_after(5):
        while True:
            samples = await scrape(http, s)
            if at(samples, name, **labels) == expected:
                return samples
            await anyio.sleep(0.02)


async def test_iteration_tokens_count_the_prompt_computed_and_every_token_per_step() -> None:
    async with served(step_time=0.001) as s, httpx.AsyncClient() as http:
        first = await complete(http, s, 8)
        second = await complete(http, s, 5)
        usage = [first["usage"], second["usage"]]
        samples = await scrape(http, s)
        generated = sum(u["completion_tokens"] for u in usage)
        computed = at(samples, "vllm:prompt_tokens_by_source_total",
                      **engine(s, source="local_compute"))
        assert computed is not None and computed > 0
        # One observation per batch of outputs: one token per step for each request alone.
        assert at(samples, "vllm:iteration_tokens_total_count", **engine(s)) == generated
        assert at(samples, "vllm:iteration_tokens_total_sum", **engine(s)) == \
            generated + computed
        assert at(samples, "vllm:iteration_tokens_total_bucket", **engine(s, le="+Inf")) == \
            generated


async def test_prefix_cache_hits_are_device_cached_tokens_and_the_rest_is_zero() -> None:
    async with served(step_time=0.001) as s, httpx.AsyncClient() as http:
        for _ in range(3):  # the same prompt: the later ones hit the mock's prefix cache
            await complete(http, s, 4, " ".join([PROMPT] * 8))
        samples = await scrape(http, s)
        hits = at(samples, "vllm:prefix_cache_hits_total", **engine(s))
        assert hits is not None and hits > 0
        samples = await settled(http, s, "vllm:prompt_tokens_cached_by_source_total",
                                engine(s, source="device"), hits)
        for source in ("host", "p2p", "disk", "external_unspecified"):
            assert at(samples, "vllm:prompt_tokens_cached_by_source_total",
                      **engine(s, source=source)) == 0
        for name in ("vllm:external_prefix_cache_queries_total",
                     "vllm:external_prefix_cache_hits_total", "vllm:mm_cache_queries_total",
                     "vllm:mm_cache_hits_total", "vllm:estimated_flops_per_gpu_total",
                     "vllm:estimated_read_bytes_per_gpu_total",
                     "vllm:estimated_write_bytes_per_gpu_total"):
            assert at(samples, name, **engine(s)) == 0, name
        for reason in ("max_num_queued_reqs", "max_num_queued_tokens"):
            assert at(samples, "vllm:admission_rejections_total",
                      model_name=engine(s)["model_name"], reason=reason) == 0


async def test_connector_and_perf_statistics_are_added_up(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine with a KV connector and MFU metrics: its per-step connector and perf
    statistics (added here to every statistics map the mock sends) are summed."""
    sent = {"queries": 0, "hits": 0, "host": 0, "flops": 0, "read": 0, "write": 0}
    original = mock_step.Stepper.stats_bytes

    def with_connector_and_perf(self: mock_step.Stepper) -> bytes:
        stats = msgpack.unpackb(original(self), raw=False)
        stats["connector_prefix_cache_stats"] = {
            "reset": False, "requests": 1, "queries": 7, "hits": 3,
            "preempted_requests": 0, "preempted_queries": 0, "preempted_hits": 0,
            "hits_by_source": {"host": 2, "disk": 0}}
        stats["perf_stats"] = {"num_flops_per_gpu": 1000, "num_read_bytes_per_gpu": 20,
                               "num_write_bytes_per_gpu": 3, "debug_stats": None}
        for key, value in (("queries", 7), ("hits", 3), ("host", 2), ("flops", 1000),
                           ("read", 20), ("write", 3)):
            sent[key] += value
        packed: bytes = msgpack.packb(stats)
        return packed

    monkeypatch.setattr(mock_step.Stepper, "stats_bytes", with_connector_and_perf)
    async with served(step_time=0.001) as s, httpx.AsyncClient() as http:
        await complete(http, s, 6)
        with anyio.fail_after(5):
            while True:
                samples = await scrape(http, s)
                flops = at(samples, "vllm:estimated_flops_per_gpu_total", **engine(s))
                if flops == sent["flops"] > 0:
                    break
                await anyio.sleep(0.02)
        steps = sent["flops"] // 1000
        assert at(samples, "vllm:external_prefix_cache_queries_total", **engine(s)) == 7 * steps
        assert at(samples, "vllm:external_prefix_cache_hits_total", **engine(s)) == 3 * steps
        assert at(samples, "vllm:prompt_tokens_cached_by_source_total",
                  **engine(s, source="host")) == 2 * steps
        assert at(samples, "vllm:estimated_read_bytes_per_gpu_total", **engine(s)) == 20 * steps
        assert at(samples, "vllm:estimated_write_bytes_per_gpu_total", **engine(s)) == 3 * steps


async def test_engine_sleep_state_follows_the_clients_sleep_and_wake_up() -> None:
    async with served(step_time=0.001) as s, httpx.AsyncClient() as http:
        def state(samples: dict[tuple[str, frozenset[tuple[str, str]]], float]) -> list[
                float | None]:
            return [at(samples, "vllm:engine_sleep_state", **engine(s, sleep_state=name))
                    for name in ("awake", "weights_offloaded", "discard_all")]

        await complete(http, s, 2)  # the engine's series appear once it is seen
        assert state(await scrape(http, s)) == [1, 0, 0]
        engine_client = s.setup.text.client.engine
        await engine_client.sleep(1)
        assert state(await scrape(http, s)) == [0, 1, 0]
        await engine_client.wake_up()
        assert state(await scrape(http, s)) == [1, 0, 0]
        await engine_client.sleep(2)
        assert state(await scrape(http, s)) == [0, 0, 1]
        await engine_client.wake_up()
        assert state(await scrape(http, s)) == [1, 0, 0]


async def test_http_families_count_requests_by_handler_method_and_status() -> None:
    async with served(step_time=0.001) as s, httpx.AsyncClient() as http:
        body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 3}).encode()
        for _ in range(3):
            response = await http.post(f"{s.v1}/completions", content=body,
                                       headers={"content-type": "application/json"})
            assert response.status_code == 200
        models = [await http.get(f"{s.v1}/models") for _ in range(2)]
        missing = await http.get(f"{s.base_url}/v1/nothing-here")
        wrong_method = await http.get(f"{s.v1}/completions")
        for _ in range(4):  # excluded, as vLLM excludes them
            assert (await http.get(f"{s.base_url}/health")).status_code == 200
        assert (missing.status_code, wrong_method.status_code) == (404, 405)
        samples = await scrape(http, s)

    def total(method: str, status: str, handler: str) -> float | None:
        return at(samples, "http_requests_total", method=method, status=status,
                  handler=handler)

    assert total("POST", "2xx", "/v1/completions") == 3
    assert total("GET", "2xx", "/v1/models") == 2
    assert total("GET", "4xx", "none") == 1
    assert total("GET", "4xx", "/v1/completions") == 1
    handlers = {dict(labels).get("handler") for name, labels in samples
                if name.startswith("http_")}
    assert not {h for h in handlers if h and ("/health" in h or "/metrics" in h)}
    assert at(samples, "http_request_size_bytes_sum", handler="/v1/completions") == \
        3 * len(body)
    assert at(samples, "http_request_size_bytes_count", handler="/v1/completions") == 4
    assert at(samples, "http_response_size_bytes_sum", handler="/v1/models") == \
        sum(len(r.content) for r in models)
    assert at(samples, "http_request_duration_seconds_count", method="POST",
              handler="/v1/completions") == 3
    assert at(samples, "http_request_duration_highr_seconds_count") == 3 + 2 + 1 + 1
    assert at(samples, "http_request_duration_seconds_bucket", method="GET",
              handler="/v1/models", le="+Inf") == 2
