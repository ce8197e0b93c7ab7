"""Shared helpers for the generate-layer tests: a generate ``Client`` over fake engines,
request/output builders, and Prometheus exposition parsing."""

from __future__ import annotations

import gc
import itertools
import re
import warnings
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from typing import Any

import numpy as np
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from anyio_genout import (
    Client,
    ClientConfig,
    GenerateRequest,
    SamplingParams,
)
from anyio_genout.protocol import (
    EngineCoreEvent,
    EngineCoreEventType,
    EngineCoreFinishReason,
    EngineCoreOutput,
    Logprobs,
    PrefillStats,
    SamplingMask,
)
from tests.engine.fake import Cluster, FakeEngine

LENGTH = EngineCoreFinishReason.LENGTH
STOP = EngineCoreFinishReason.STOP
QUEUED = EngineCoreEventType.QUEUED
SCHEDULED = EngineCoreEventType.SCHEDULED
PREEMPTED = EngineCoreEventType.PREEMPTED

#: ``"{external}-{8 lowercase hex chars}"``.
INTERNAL_SUFFIX = r"-[0-9a-f]{8}"

_model_names = itertools.count()


def unique_model_name(prefix: str) -> str:
    """A model name (the ``model_name`` label) no other test uses."""
    return f"{prefix}-{next(_model_names)}"


@asynccontextmanager
async def generate_cluster(engines: int = 1, *, model_name: str = "genout-test",
                           randomize_request_ids: bool = True, eos_token_id: int | None = None,
                           **engine_config: Any) -> AsyncIterator[tuple[Client, list[FakeEngine]]]:
    """Fake engines, a connected engine-core client, and the generate ``Client`` over it.

    The fakes are scripted (``tests/engine/fake.py``: the test sends each output itself);
    for mock engines that generate on their own, ``tests/cluster.py``."""
    async with Cluster(engines, **engine_config) as (engine_client, fakes):
        config = ClientConfig(model_name=model_name, registry=None,
                              randomize_request_ids=randomize_request_ids,
                              eos_token_id=eos_token_id)
        yield Client(engine_client, config), fakes


def request(request_id: str, *, max_tokens: int | None = 8, arrival_time: float | None = 42.5,
            **params: Any) -> GenerateRequest:
    """The reference fixture request: prompt [11, 22], arrival 42.5, priority 0."""
    extra = {k: params.pop(k) for k in ("data_parallel_rank", "cache_salt", "trace_headers",
                                        "priority", "lora_request") if k in params}
    return GenerateRequest(
        request_id=request_id,
        prompt_token_ids=[11, 22],
        sampling_params=SamplingParams(temperature=0.0, max_tokens=max_tokens, **params),
        arrival_time=arrival_time,
        **extra,
    )


def output(request_id: str, tokens: Sequence[int], finish: EngineCoreFinishReason | None = None,
           *events: tuple[EngineCoreEventType, float], **fields: Any) -> EngineCoreOutput:
    return EngineCoreOutput(
        request_id, list(tokens), finish_reason=finish,
        events=[EngineCoreEvent(kind, ts) for kind, ts in events] or None, **fields)


def logprobs(tokens: Sequence[int], *, top: int = 1, base: float = -0.5) -> Logprobs:
    """Logprobs with ``top`` extra candidates per position, float32 as on the wire."""
    n = len(tokens)
    ids = np.array([[t, *range(1000 + t, 1000 + t + top)] for t in tokens], dtype=np.int32)
    lps = np.array([[base * (i + 1) - j for j in range(top + 1)] for i in range(n)],
                   dtype=np.float32)
    return Logprobs(ids.reshape(n, top + 1), lps.reshape(n, top + 1),
                    np.ones(n, dtype=np.int64))


def mask(*rows: Sequence[int]) -> SamplingMask:
    """A CSR sampling mask with one row per position."""
    offsets = np.zeros(len(rows) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(r) for r in rows])
    return SamplingMask(np.array([t for r in rows for t in r], dtype=np.int32), offsets)


def prefill(**counts: int) -> PrefillStats:
    return PrefillStats(**counts)


# ---------------------------------------------------------------------- metrics


Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(client: Client) -> Samples:
    """Render the client's registry as Prometheus text and parse it back (label order free)."""
    text = generate_latest(client.metrics.registry).decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def sample(samples: Samples, name: str, engine: int | str, model_name: str,
           **extra: str) -> float | None:
    labels = {"model_name": model_name, "engine": str(engine), **extra}
    return samples.get((name, frozenset(labels.items())))


def finished_counts(client: Client, engine: int = 0) -> dict[str, float]:
    """``vllm:request_success_total`` by ``finished_reason`` (non-zero only)."""
    counts: dict[str, float] = {}
    for (name, labels), value in scrape(client).items():
        label = dict(labels)
        if name == "vllm:request_success_total" and label["engine"] == str(engine) and value:
            assert label["model_name"] == client.metrics.model_name
            counts[label["finished_reason"]] = value
    return counts


def histogram_count(client: Client, name: str, engine: int = 0) -> float | None:
    return sample(scrape(client), f"{name}_count", engine, client.metrics.model_name)


# ---------------------------------------------------------------------- hygiene


@contextmanager
def no_resource_warnings() -> Iterator[None]:
    """Record every warning raised inside (including from ``__del__``), collect garbage at
    the end, and fail on any ResourceWarning (unclosed memory streams, sockets...)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
        gc.collect()
        gc.collect()
    leaked = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert not leaked, leaked


def internal_id_pattern(external: str) -> re.Pattern[str]:
    return re.compile(re.escape(external) + INTERNAL_SUFFIX + "$")
