"""Our field table (``anyio_genout/server/fields.py``) names every field of vLLM's
completions and chat completions bodies, responses and stream chunks, so that a new vLLM field
cannot be dropped silently (issue 24 item 2).

Needs vLLM importable (the interop venv: ``nox -s interop``); skipped elsewhere.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest

from anyio_genout.server import models
from anyio_genout.server.fields import (
    CHAT_ONLY,
    COMPLETION_ONLY,
    REFUSED,
    REQUEST_FIELDS,
    RESPONSE_FIELDS,
)

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # vLLM's and torch's import-time deprecation noise
    pytest.importorskip("vllm", reason="needs vLLM (the interop venv)")
    from vllm.entrypoints.openai.chat_completion import protocol as chat
    from vllm.entrypoints.openai.completion import protocol as completion

_REQUESTS: dict[str, Any] = {"completion": completion.CompletionRequest,
                             "chat": chat.ChatCompletionRequest}
_RESPONSES = (completion.CompletionResponse, completion.CompletionResponseChoice,
              completion.CompletionStreamResponse, completion.CompletionResponseStreamChoice,
              chat.ChatCompletionResponse, chat.ChatCompletionResponseChoice,
              chat.ChatCompletionStreamResponse, chat.ChatCompletionResponseStreamChoice)


@pytest.mark.parametrize("route", sorted(_REQUESTS))
def test_every_vllm_request_field_is_in_the_table(route: str) -> None:
    fields = set(_REQUESTS[route].model_fields)
    missing = sorted(fields - set(REQUEST_FIELDS))
    assert not missing, f"vLLM's {route} fields not in server/fields.py: {missing}"
    other = COMPLETION_ONLY if route == "chat" else CHAT_ONLY
    assert not sorted(fields & other), "a field of this route is marked the other route's"


def test_the_table_names_no_field_vllm_lacks() -> None:
    every = set().union(*(set(model.model_fields) for model in _REQUESTS.values()))
    assert sorted(set(REQUEST_FIELDS) - every) == []


def test_every_vllm_response_field_is_in_the_table() -> None:
    named = {f"{model.__name__}.{field}" for model in _RESPONSES for field in model.model_fields}
    assert sorted(named - set(RESPONSE_FIELDS)) == []
    assert sorted(set(RESPONSE_FIELDS) - named) == []


def test_implemented_and_ignored_fields_are_declared_by_our_models() -> None:
    """What is not refused is a field of our pydantic body (so it is read, typed, checked),
    except what is ignored."""
    ours = {"completion": models.CompletionRequest, "chat": models.ChatCompletionRequest}
    for route, model in ours.items():
        for name in set(_REQUESTS[route].model_fields):
            kind, _ = REQUEST_FIELDS[name]
            if kind != REFUSED:
                assert name in model.model_fields or kind == "ignored", (route, name)
