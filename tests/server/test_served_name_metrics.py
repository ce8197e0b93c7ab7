"""``anyio-genout serve`` labels its metrics with the served model name, as ``vllm serve``
does (a dashboard filtering on ``model_name`` finds them); ``--model-name`` still wins."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.support import serve_process

pytestmark = pytest.mark.timeout(60)


def _model_names(*options: str) -> tuple[set[str], float | None]:
    """The ``model_name`` labels of every ``vllm:`` sample after one completion, and its
    ``vllm:request_success_total`` over every finished reason (the mock engine samples at
    random, so about one completion in 300 meets an end-of-sequence token within its 3
    tokens and ends as "stop", not "length")."""
    with serve_process(*options) as server:
        base = server.base
        model = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
        done = httpx.post(f"{base}/v1/completions", json={
            "model": model, "prompt": "Once upon a time", "max_tokens": 3})
        assert done.status_code == 200, done.text
        text = httpx.get(f"{base}/metrics").text
    names, success = set(), None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("vllm:"):
                names.add(sample.labels["model_name"])
            if sample.name == "vllm:request_success_total":
                success = (success or 0.0) + sample.value
    return names, success


def test_metrics_carry_the_served_model_name() -> None:
    assert _model_names("--served-model-name", "my-served-model") == ({"my-served-model"}, 1.0)


def test_model_name_option_overrides_the_served_name() -> None:
    assert _model_names("--served-model-name", "served", "--model-name", "label") == (
        {"label"}, 1.0)


def test_without_names_the_label_stays_anyio_genout() -> None:
    assert _model_names() == ({"anyio-genout"}, 1.0)
