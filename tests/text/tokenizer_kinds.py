"""Test support: Hugging Face tokenizer folders of the two kinds the text layer must handle.

Built with ``tokenizers`` only, offline and deterministically, once per process in a temporary
folder (:func:`byte_level_dir`, :func:`sentencepiece_dir`); both folders load in
``transformers.AutoTokenizer`` (``tokenizer.json`` + ``tokenizer_config.json``), which the
interop differential test uses to build vLLM's own detokenizer on the same files.

``byte_level``
    the project's shipped byte-level BPE (``anyio_genout/text/bundled/``): every byte is a
    token, so a multi-byte character often spans several tokens.
``sentencepiece``
    a Llama-2-style BPE with ``byte_fallback`` (``<0x00>`` .. ``<0xFF>`` byte tokens for
    characters outside its alphabet), a ``Metaspace`` pre-tokenizer (``prepend_scheme``
    ``"first"``) and the decoder ``Replace("▁", " ")``, ``ByteFallback``, ``Fuse``,
    ``Strip(left 1)``; specials ``<unk>`` ``<s>`` ``</s>``; trained on the same multi-script
    corpus with a small alphabet, so CJK and emoji go through byte tokens.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import tempfile
from pathlib import Path

from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)
from tokenizers.trainers import BpeTrainer

BUNDLED = Path(__file__).resolve().parents[2] / "anyio_genout" / "text" / "bundled"
KINDS = ("byte_level", "sentencepiece")

SP_SPECIALS = ("<unk>", "<s>", "</s>")
SP_TRAINED = 700       # tokens the BPE trainer learns (alphabet + merges)
SP_ALPHABET = 120      # characters kept in the alphabet; the rest fall back to bytes


@functools.cache
def _workdir() -> Path:
    path = Path(tempfile.mkdtemp(prefix="anyio-genout-tokenizers-"))
    atexit.register(shutil.rmtree, path, True)
    return path


def corpus() -> str:
    """The multi-script text both tokenizers are trained on (the project's shipped corpus)."""
    return (BUNDLED / "corpus.txt").read_text(encoding="utf-8")


def byte_level_dir() -> Path:
    """The shipped byte-level BPE folder."""
    return BUNDLED


@functools.cache
def sentencepiece_dir() -> Path:
    """A SentencePiece-style (Llama-2-like) tokenizer folder, built once per process."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread: the same merges every run
    metaspace = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    draft = Tokenizer(models.BPE(unk_token="<unk>"))
    draft.pre_tokenizer = metaspace
    trainer = BpeTrainer(vocab_size=SP_TRAINED, limit_alphabet=SP_ALPHABET, min_frequency=2,
                         show_progress=False, special_tokens=[])
    draft.train_from_iterator(corpus().splitlines(), trainer=trainer)
    trained = json.loads(draft.to_str())["model"]
    vocab: dict[str, int] = {token: i for i, token in enumerate(SP_SPECIALS)}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for token, _ in sorted(trained["vocab"].items(), key=lambda item: item[1]):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in trained["merges"]]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>",
                                     byte_fallback=True, fuse_unk=True))
    tokenizer.normalizer = normalizers.Sequence([])
    tokenizer.pre_tokenizer = metaspace
    tokenizer.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
        decoders.Strip(content=" ", left=1, right=0)])
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t in SP_SPECIALS])
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1", special_tokens=[("<s>", 1)])
    folder = _workdir() / "sentencepiece"
    folder.mkdir()
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": True, "add_eos_token": False,
        "clean_up_tokenization_spaces": False, "model_max_length": 4096,
        "added_tokens_decoder": {
            str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                     "single_word": False, "special": True}
            for i, t in enumerate(SP_SPECIALS)},
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return folder


def kind_dir(kind: str) -> Path:
    """The folder of one kind (see :data:`KINDS`)."""
    if kind == "byte_level":
        return byte_level_dir()
    if kind == "sentencepiece":
        return sentencepiece_dir()
    raise ValueError(f"unknown tokenizer kind {kind!r}")


@functools.cache
def load(kind: str) -> Tokenizer:
    """The fast tokenizer of one kind (one instance per process)."""
    return Tokenizer.from_file(str(kind_dir(kind) / "tokenizer.json"))


def common_prefix(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def clean_cut(tok: Tokenizer, prompt: list[int], skip: bool) -> int:
    """The length of the longest prompt prefix whose text does not end in U+FFFD."""
    cut = len(prompt)
    while cut and tok.decode(prompt[:cut], skip_special_tokens=skip).endswith("\ufffd"):
        cut -= 1
    return cut


def reference_text(tok: Tokenizer, prompt: list[int], output: list[int], skip: bool) -> str:
    """The output's text by the detokenizer's guarantee, from full decodes only.

    With ``P0`` the longest prompt prefix whose text ends cleanly and ``T`` what the rest of the
    prompt shows after it: ``decode(prompt + output')`` after ``decode(P0)``, less its common
    prefix with ``T`` (the prompt's unfinished tail is not repeated unless the output changes
    it), ``output'`` the longest prefix of ``output`` whose decode with the prompt ends
    cleanly (the tokens after it, an unfinished character at the end, give no text, as in
    vLLM). Raises AssertionError if the decode does not start with ``decode(P0)``.
    """
    def decode(ids: list[int]) -> str:
        return str(tok.decode([t for t in ids if 0 <= t < 2**32], skip_special_tokens=skip))

    end = len(output)
    while end and decode(prompt + output[:end]).endswith("\ufffd"):
        end -= 1
    seed = decode(prompt[:clean_cut(tok, prompt, skip)])
    whole = decode(prompt)
    tail = whole[common_prefix(whole, seed):]
    full = decode(prompt + output[:end])
    assert full.startswith(seed), (full, seed)
    text = full[len(seed):]
    return text[common_prefix(text, tail):]
