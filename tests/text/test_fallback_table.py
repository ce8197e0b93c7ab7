"""The byte-fallback table (Llama 2 / Mistral / Gemma decoders) gives every step the text the
``DecodeStream`` path gives, and the library's own decode where the detokenizer guarantees
it: random ids (byte pieces, specials, unknown and bad ids among real text), prompts ending
inside a character, the first token's stripped space, an unfinished character at the end.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders
from tokenizers.decoders import DecodeStream

from anyio_genout.bench.tokenizers import build_model_dir
from anyio_genout.text.detokenizer import IncrementalDetokenizer
from anyio_genout.text.fallback_table import FallbackStream, fallback_table
from tests.text.byte_level_kinds import stream_path
from tests.text.tokenizer_kinds import load, reference_text

TEXT = ("The lamp 灯塔的守护者 日本語 등대지기는 Crème brûlée 🌊🌬️ 😀👍🏽 e\u0301 "
        "\ufffd ok 中x 🙂  two  spaces")
BAD_IDS = (-1, -(2**40), 2**32 - 1, 2**32, 2**64)
KINDS = ("sentencepiece", "gemma", "built")
EXAMPLES = settings(max_examples=200, derandomize=True, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow])
REPLACEMENT = "\ufffd"


@functools.cache
def _built_dir() -> Path:
    import tempfile

    return build_model_dir("sp-bytefallback-32k", Path(tempfile.mkdtemp(
        prefix="anyio-genout-fallback-")))


@functools.cache
def tokenizer(kind: str) -> Tokenizer:
    if kind == "sentencepiece":
        return load("sentencepiece")
    if kind == "gemma":  # the same without the Strip: no leading space is dropped
        tok = Tokenizer.from_str(load("sentencepiece").to_str())
        tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                         decoders.Fuse()])
        return tok
    return Tokenizer.from_file(str(_built_dir() / "tokenizer.json"))


def byte_id(tok: Tokenizer, byte: int) -> int:
    token_id = tok.token_to_id(f"<0x{byte:02X}>")
    assert token_id is not None
    return token_id


def run_both(tok: Tokenizer, prompt: list[int], output: Sequence[object], skip: bool
             ) -> tuple[list[str], list[str]]:
    def run_one() -> list[str]:
        detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
        assert isinstance(detok._stream, FallbackStream | DecodeStream)
        kinds.append(type(detok._stream))
        texts = [detok.step(t) for t in output]  # type: ignore[arg-type]
        detok.finish()
        return texts

    assert fallback_table(tok, skip) is not None
    kinds: list[type] = []
    fast = run_one()
    with stream_path():
        slow = run_one()
    assert kinds == [FallbackStream, DecodeStream]
    return fast, slow


@st.composite
def case(draw: st.DrawFn, kind: str, noise: bool) -> tuple[list[int], list[int]]:
    tok = tokenizer(kind)
    size = tok.get_vocab_size()
    start = draw(st.integers(0, len(TEXT) - 1))
    ids = tok.encode(TEXT[start:draw(st.integers(start, len(TEXT)))],
                     add_special_tokens=False).ids
    if noise:
        bytes_ = [byte_id(tok, b) for b in (0x20, 0x80, 0xC3, 0xA9, 0xE4, 0xB8, 0xAD, 0xF0,
                                            0xFF)]
        for _ in range(draw(st.integers(0, 8))):  # byte pieces, specials, any id, bad ids
            ids.insert(draw(st.integers(0, len(ids))), draw(st.one_of(
                st.sampled_from(bytes_), st.integers(0, 3), st.integers(0, size - 1),
                st.integers(size, size + 3), st.sampled_from(BAD_IDS))))
    cut = draw(st.integers(0, len(ids)))
    prompt = [t for t in ids[:cut] if 0 <= t < 2**32]
    return [1, *prompt] if draw(st.booleans()) else prompt, ids[cut:]


@pytest.mark.parametrize("kind", KINDS)
@EXAMPLES
@given(data=st.data(), skip=st.booleans())
def test_every_step_gives_the_decode_stream_text(kind: str, data: st.DataObject,
                                                 skip: bool) -> None:
    tok = tokenizer(kind)
    prompt, output = data.draw(case(kind, noise=True))
    fast, slow = run_both(tok, prompt, output, skip)
    assert fast == slow


@pytest.mark.parametrize("kind", KINDS)
@EXAMPLES
@given(data=st.data(), skip=st.booleans())
def test_the_steps_spell_the_library_decode_of_real_text(kind: str, data: st.DataObject,
                                                         skip: bool) -> None:
    # Ids of real text (byte runs valid): the steps join to decode(prompt + output) after
    # the prompt's text, an unfinished character at the end giving nothing.
    tok = tokenizer(kind)
    prompt, output = data.draw(case(kind, noise=False))
    fast, _ = run_both(tok, prompt, output, skip)
    assert "".join(fast) == reference_text(tok, prompt, output, skip)
    assert all(not text.endswith(REPLACEMENT) for text in fast if text)


def test_pinned_corners() -> None:
    tok = tokenizer("sentencepiece")
    byte = {b: byte_id(tok, b) for b in range(256)}
    space_a = tok.encode("x a", add_special_tokens=False).ids[-1]
    x = tok.encode("x", add_special_tokens=False).ids
    cases: list[tuple[list[int], list[int]]] = [
        ([], [space_a, space_a]),  # the first space stripped, the second kept
        ([1], [space_a]),  # a skipped <s> contributes nothing: still stripped
        ([], [byte[0x20], byte[0xC3], space_a]),  # the <0x20> of an invalid run: no strip
        ([], [byte[0x20], byte[0xC3], byte[0xA9], space_a]),  # " é": stripped to "é"
        (x, [byte[0xE4], byte[0xB8], byte[0xAD], byte[0xE4], space_a]),  # invalid prefix
        (x, [byte[0xC3], byte[0xA9], byte[0x80], byte[0xC3], byte[0xA9], space_a]),
        (x, [byte[0xC3], 1, byte[0xA9], 2, space_a]),  # specials inside a run
        (x, [byte[0xEF], byte[0xBF], byte[0xBD], space_a]),  # a literal U+FFFD in bytes
        ([*x, byte[0xE4]], [byte[0xB8], byte[0xAD], space_a]),  # prompt inside a character
        (x, [byte[0xF0], byte[0x9F]]),  # unfinished at the end: no text
    ]
    for (prompt, output), skip in itertools.product(cases, (True, False)):
        fast, slow = run_both(tok, prompt, output, skip)
        assert fast == slow, (prompt, output, skip)
    assert run_both(tok, [], [space_a, space_a], True)[0] == ["a", " a"]


def test_bad_ids_raise_what_the_library_step_raises() -> None:
    tok = tokenizer("sentencepiece")
    table = fallback_table(tok, True)
    assert table is not None
    stream = FallbackStream(table, [])
    for bad in (-1, 2**32, 2**64):
        with pytest.raises(OverflowError):
            stream.step(tok, bad)
    for odd in (70.0, "70", None):
        with pytest.raises(TypeError):
            stream.step(tok, odd)  # type: ignore[arg-type]


def test_only_the_byte_fallback_decoders_get_a_table() -> None:
    assert fallback_table(load("byte_level"), True) is None
    tok = Tokenizer.from_str(load("sentencepiece").to_str())
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 2, 0)])
    assert fallback_table(tok, True) is None
    tok.decoder = decoders.Metaspace()
    assert fallback_table(tok, True) is None
    assert fallback_table(tokenizer("gemma"), True) is not None
    assert fallback_table(tokenizer("sentencepiece"), False) is not None
