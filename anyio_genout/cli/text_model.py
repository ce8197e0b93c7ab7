"""The command line's text side: which tokenizer folder, the text options, the mock's corpus.

Where the tokenizer comes from (both ``generate`` and ``run``):

* ``--model DIR``: that Hugging Face model folder (``tokenizer.json`` and its configs);
* else ``--vllm-model PATH``: the managed engines' own folder;
* else, with ``--handshake-address``: none (the remote engines' model is unknown here);
* else (the embedded mock engine): the folder shipped with anyio-genout, and the mock
  continues its corpus, encoded with the tokenizer, so the text reads as text.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Final

from ..errors import ModelFolderError, UsageError
from ..text.bundled import bundled_corpus, bundled_model_dir
from ..text.tokenizer import Tokenizer

__all__ = ["NO_TOKENIZER", "add_model_option", "add_text_options", "load_tokenizer",
           "mock_corpus", "tokenizer_folder"]

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


def mock_corpus(tokenizer: Tokenizer) -> tuple[int, ...]:
    """The shipped corpus as token ids of ``tokenizer``: what the embedded mock continues."""
    return tuple(tokenizer.encode(bundled_corpus(), add_special_tokens=False))
