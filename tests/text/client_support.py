"""Helpers for the text-client tests: a :class:`TextClient` with the shipped tokenizer over a
real mock engine (real ZeroMQ) that continues the shipped corpus, and its predictions."""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from anyio_genout.generate import Client
from anyio_genout.mock import MockEngine, greedy_tokens
from anyio_genout.protocol import AddRequest
from anyio_genout.text.bundled import bundled_corpus, bundled_tokenizer
from anyio_genout.text.client import TextClient
from anyio_genout.text.tokenizer import Tokenizer
from tests.cluster import MockCluster, generate_client
from tests.faults.support import success_total

__all__ = ["PROMPT", "TextSetup", "added", "corpus", "predicted", "success_total",
           "text_client", "tokenizer"]

#: The prompt most tests send.
PROMPT = "Once upon a time"


def tokenizer() -> Tokenizer:
    return bundled_tokenizer()


@functools.cache
def corpus() -> tuple[int, ...]:
    """The shipped corpus in the shipped tokenizer's ids (what the CLI's mock continues)."""
    return tuple(tokenizer().encode(bundled_corpus(), add_special_tokens=False))


def predicted(prompt_ids: Sequence[int], count: int) -> list[int]:
    """The ids the corpus-mode mock generates greedily for ``prompt_ids`` (no stops)."""
    return greedy_tokens(prompt_ids, count, corpus=corpus())


class TextSetup:
    def __init__(self, text: TextClient, cluster: MockCluster) -> None:
        self.text = text
        self.client: Client = text.client
        self.cluster = cluster

    @property
    def engine(self) -> MockEngine:
        return self.cluster.engine


@asynccontextmanager
async def text_client(*, text_tokenizer: Tokenizer | None = None,
                      **mock: Any) -> AsyncIterator[TextSetup]:
    """A :class:`TextClient` (``text_tokenizer``, else the shipped one) over one
    corpus-mode mock engine.

    The mock's model never emits EOS on its own (``eos_token_id`` unset) unless ``mock``
    says otherwise, so the tests choose how requests end."""
    config = {"corpus_token_ids": corpus(), "vocab_size": 32000, **mock}
    async with generate_client(mock=config, vocab_size=config["vocab_size"]) as (client,
                                                                               cluster):
        yield TextSetup(TextClient(client, text_tokenizer or tokenizer()), cluster)


def added(engine: MockEngine) -> list[AddRequest]:
    """Every ADD the mock engine received, in order."""
    return [r for r in engine.received if isinstance(r, AddRequest)]
