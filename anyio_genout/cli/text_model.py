"""The command line's text side: which tokenizer folder, the text options, the mock's corpus.

Where the tokenizer comes from (both ``generate`` and ``run``):

* ``--model DIR``: that Hugging Face model folder (``tokenizer.json`` and its configs);
* else ``--vllm-model PATH``: the managed engines' own folder;
* else, with ``--handshake-address``: none (the remote engines' model is unknown here);
* else (the embedded mock engine): the folder shipped with anyio-genout, and the mock
  continues its corpus, encoded with the tokenizer, so the text reads as text
  (:func:`mock_model`: also what ``mock-engine --model DIR`` passes for).
"""

from __future__ import annotations

import argparse
import functools
import re
from pathlib import Path
from typing import Any, Final

import attrs

from ..errors import ModelFolderError, UsageError
from ..text.bundled import bundled_corpus, bundled_model_dir
from ..text.tokenizer import Tokenizer

__all__ = ["NO_TOKENIZER", "MockModel", "add_model_option", "add_text_options",
           "load_tokenizer", "mock_model", "tokenizer_folder"]

#: What a text request without a tokenizer is told.
NO_TOKENIZER: Final = ("needs a tokenizer: give --model DIR (the engines' model folder); "
                       "with --handshake-address there is no default")


def add_model_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", metavar="DIR",
        help="model folder whose tokenizer encodes text prompts and decodes the output "
             "(tokenizer.json, tokenizer_config.json, ...) (default: the --vllm-model "
             "folder; with --handshake-address none, so text needs it; with the embedded "
             "mock engine the small tokenizer shipped with anyio-genout)")


def add_text_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("text", "options of the text a prompt generates")
    group.add_argument("--stop", action="append", default=[], metavar="TEXT",
                       help="stop string: the generation ends where it first appears, and "
                            "the text is cut before it (repeatable; default: none)")
    group.add_argument("--include-stop-str-in-output", action="store_true",
                       help="keep the matched stop string at the end of the text "
                            "(default: off)")
    group.add_argument("--skip-special-tokens", action=argparse.BooleanOptionalAction,
                       default=True,
                       help="leave special tokens (<s>, </s>, ...) out of the text "
                            "(default: on)")


def tokenizer_folder(args: argparse.Namespace) -> Path | None:
    """The folder the tokenizer is read from (see the module docstring), None if none."""
    if args.model is not None:
        return Path(args.model)
    if args.vllm_model:
        return Path(args.vllm_model)
    if args.handshake_address is not None:
        return None
    return bundled_model_dir()


def load_tokenizer(args: argparse.Namespace, *, required: bool) -> Tokenizer | None:
    """The tokenizer of :func:`tokenizer_folder`.

    Not ``required`` (token-id requests can do without), a ``--vllm-model`` folder without
    a tokenizer gives None; so does no folder at all.

    Raises:
        ModelFolderError: the folder cannot be read (missing ``tokenizer.json``, malformed
            json), for ``--model`` always, for the ``--vllm-model`` folder if ``required``.
        UsageError: ``required`` and there is no folder (``--handshake-address`` without
            ``--model``).
    """
    folder = tokenizer_folder(args)
    if folder is None:
        if required:
            raise UsageError(f"text {NO_TOKENIZER}")
        return None
    try:
        return Tokenizer.from_model_dir(folder)
    except ModelFolderError:
        if required or args.model is not None:
            raise
        return None


@attrs.frozen
class MockModel:
    """What a mock engine needs to pass for a model with ``tokenizer`` (:func:`mock_model`):
    ``vocab_size`` (the tokenizer's tokens, so every id it generates decodes), its
    ``eos_token_id``, the shipped corpus as its ``corpus`` of token ids with the
    ``corpus_starts`` of its sentences, and the ``alternatives`` logprobs may show: the ids
    whose token strings are distinct and readable (not special, not empty, printable: no
    U+FFFD of a character's partial bytes, no control character)."""

    vocab_size: int
    eos_token_id: int | None
    corpus: tuple[int, ...] = attrs.field(repr=False)
    corpus_starts: tuple[int, ...] = attrs.field(repr=False)
    alternatives: tuple[int, ...] = attrs.field(repr=False)

    def config_fields(self) -> dict[str, Any]:
        """The :class:`~anyio_genout.mock.MockEngineConfig` fields it sets."""
        return {"vocab_size": self.vocab_size, "eos_token_id": self.eos_token_id,
                "corpus_token_ids": self.corpus, "corpus_starts": self.corpus_starts,
                "alternative_token_ids": self.alternatives}


#: Where a sentence (or a paragraph) of the corpus ends: its next one starts after this.
_SENTENCE_END: Final = re.compile(
    r"[.!?][\"'\u201d\u2019\u00bb)\]]*\s+"  # . ! ? (closing quotes), then white space
    r"|[\u3002\uff01\uff1f][\u201d\u2019\u300d\u300f)]*\s*"  # the CJK full stops
    r"|\n\s*\n\s*")  # a paragraph's end


@functools.lru_cache(maxsize=4)
def mock_model(tokenizer: Tokenizer) -> MockModel:
    """The mock engine's model for ``tokenizer``: its vocabulary, EOS, the shipped corpus
    encoded sentence by sentence (each sentence's first token a start), and the
    alternatives (see :class:`MockModel`)."""
    text = bundled_corpus()
    pieces: list[str] = []
    begin = 0
    for match in _SENTENCE_END.finditer(text):
        pieces.append(text[begin:match.end()])
        begin = match.end()
    pieces.append(text[begin:])
    corpus: list[int] = []
    starts: list[int] = []
    for piece in filter(None, pieces):
        ids = tokenizer.encode(piece, add_special_tokens=False)
        if ids:
            starts.append(len(corpus))
            corpus += ids
    size = tokenizer.backend.get_vocab_size(with_added_tokens=True)
    eos = tokenizer.eos_token_id
    size = max(size, max(corpus) + 1, -1 if eos is None else eos + 1)
    seen: set[str] = set()
    alternatives: list[int] = []
    special = tokenizer.special_token_ids
    for token_id, string in enumerate(tokenizer.token_strings(list(range(size)))):
        if (string and string not in seen and token_id not in special
                and all(ch.isprintable() or ch in "\n\t" for ch in string)):
            seen.add(string)
            alternatives.append(token_id)
    return MockModel(size, eos, tuple(corpus), tuple(starts), tuple(alternatives))
