"""The tokenizer folder the project ships, and the text it was trained on.

``anyio_genout/text/bundled/`` is a Hugging Face model folder without weights (a 1024-token
byte-level BPE with a ChatML chat template, written by ``tools/build_tokenizer.py``), so text
works on a fresh machine with no downloads; the embedded mock engine generates ids in its
vocabulary. ``corpus.txt`` is the original prose (English and several other scripts) it was
trained on.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Final

from .tokenizer import Tokenizer

_FOLDER: Final = Path(__file__).resolve().parent / "bundled"
CORPUS_FILE: Final = "corpus.txt"


def bundled_model_dir() -> Path:
    """The shipped folder: ``tokenizer.json``, ``tokenizer_config.json`` (with the chat
    template), ``generation_config.json``, ``config.json`` and ``corpus.txt``."""
    return _FOLDER


@functools.cache
def bundled_corpus() -> str:
    """The shipped text the tokenizer was trained on (and the mock engine continues)."""
    return (_FOLDER / CORPUS_FILE).read_text(encoding="utf-8")


@functools.cache
def bundled_tokenizer() -> Tokenizer:
    """The shipped tokenizer, loaded once."""
    return Tokenizer.from_model_dir(_FOLDER)
