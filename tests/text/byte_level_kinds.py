"""Test support: byte-level tokenizers for the byte-table path, and its reference.

``BYTE_LEVEL`` names two tokenizers whose decoder is exactly ``ByteLevel``:

``shipped``
    the project's bundled byte-level BPE (tests.text.tokenizer_kinds's ``byte_level``);
``added``
    a small byte-level BPE trained here (other decoder flags), with added tokens whose content
    is non-ASCII: raw UTF-8 (``"中x"``, ``"🙂"``), byte-level characters standing for bytes
    that are invalid alone (``"Ġé"``, ``"Ńx"``: a continuation byte), a plain space
    (``" sp"``), and special tokens of the same kinds, one of them an existing byte token made
    special (``"Ń"``).

:func:`stream_path` makes the detokenizer built inside it take the ``DecodeStream`` path (as
before the byte table) for the same tokenizer: the reference the byte table must equal.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from unittest import mock

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from tokenizers.trainers import BpeTrainer

import anyio_genout.text.detokenizer as detokenizer_module
from tests.text.tokenizer_kinds import corpus, load

BYTE_LEVEL = ("shipped", "added")
ADDED = ("中x", "Ġé", " sp", "Ńx", "🙂")
ADDED_SPECIAL = ("<|é|>", "ĠSP", "Ń")


@functools.cache
def byte_level(kind: str) -> Tokenizer:
    """One of :data:`BYTE_LEVEL` (one instance per process)."""
    if kind == "shipped":
        return load("byte_level")
    if kind != "added":
        raise ValueError(f"unknown byte-level kind {kind!r}")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread: the same merges every run
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel(add_prefix_space=False,  # type: ignore[call-arg]
                                     use_regex=False)
    trainer = BpeTrainer(vocab_size=400, min_frequency=2, show_progress=False,
                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                         special_tokens=["<|end|>"])
    tok.train_from_iterator(corpus().splitlines(), trainer=trainer)
    tok.add_tokens([AddedToken(t, normalized=False) for t in ADDED])
    tok.add_special_tokens([AddedToken(t, normalized=False) for t in ADDED_SPECIAL])
    return tok


@contextlib.contextmanager
def stream_path() -> Iterator[None]:
    """Detokenizers made inside take the ``DecodeStream`` path, whatever the decoder."""
    with mock.patch.object(detokenizer_module, "byte_table", lambda *args: None), \
            mock.patch.object(detokenizer_module, "fallback_table", lambda *args: None):
        yield
