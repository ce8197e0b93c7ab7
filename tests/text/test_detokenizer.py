"""IncrementalDetokenizer: vLLM's incremental text, right in vLLM's three wrong corners.

The guarantee tested (see anyio_genout/text/detokenizer.py and
``tests.text.tokenizer_kinds.reference_text``): the texts of all steps are the full decode's
text after the prompt's, up to the last token whose text ends cleanly (an unfinished character
at the end gives no text, as in vLLM), whenever decode never rewrites text it produced (always
for byte-level BPE; for byte fallback as long as no byte run turns invalid).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models
from tokenizers.decoders import DecodeStream

from anyio_genout.text import detokenizer as detokenizer_module
from anyio_genout.text.byte_table import byte_table
from anyio_genout.text.detokenizer import IncrementalDetokenizer, separator_token_id
from tests.text.byte_level_kinds import ADDED, ADDED_SPECIAL, BYTE_LEVEL, byte_level, stream_path
from tests.text.tokenizer_kinds import KINDS, load, reference_text

SCRIPTS = {
    "latin": "The lamp turned, and the sea was quiet tonight.",
    "accents": "Crème brûlée, señor, façade, Ångström, naïve.",
    "cjk": "灯塔的守护者每天晚上写一行字。日本語のテキストです。",
    "hangul": "등대지기는 매일 밤 한 줄을 썼다.",
    "emoji": "Storm 🌊🌬️ then calm 😀👍🏽 and 🎉!",
}
REPLACEMENT = "\ufffd"
EXAMPLES = settings(max_examples=150, derandomize=True, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow])


def run(tok: Tokenizer, prompt: list[int], output: list[int], **options: bool
        ) -> list[str]:
    detok = IncrementalDetokenizer(tok, prompt, **options)
    texts = [detok.step(t) for t in output]
    detok.finish()
    return texts


@st.composite
def prompt_and_output(draw: st.DrawFn, kind: str, noise: bool) -> tuple[list[int], list[int]]:
    tok = load(kind)
    script = draw(st.sampled_from(sorted(SCRIPTS)))
    start = draw(st.integers(0, len(SCRIPTS[script]) - 1))
    ids = tok.encode(SCRIPTS[script][start:], add_special_tokens=False).ids
    if noise:  # any ids at all, byte tokens and specials included
        for _ in range(draw(st.integers(1, 4))):
            ids.insert(draw(st.integers(0, len(ids))),
                       draw(st.integers(0, tok.get_vocab_size() - 1)))
    cut = draw(st.integers(0, len(ids)))
    return [1, *ids[:cut]], ids[cut:]


@pytest.mark.parametrize("kind", KINDS)
@EXAMPLES
@given(data=st.data(), skip=st.booleans())
def test_the_steps_spell_the_decoded_text_in_every_script(
        kind: str, data: st.DataObject, skip: bool) -> None:
    # Byte-level decode never rewrites its text, so any ids hold; for the SentencePiece kind
    # the ids are those of real text (its byte runs are valid UTF-8).
    tok = load(kind)
    prompt, output = data.draw(prompt_and_output(kind, noise=kind == "byte_level"))
    texts = run(tok, prompt, output, skip_special_tokens=skip)
    assert "".join(texts) == reference_text(tok, prompt, output, skip)
    assert all(not text.endswith(REPLACEMENT) for text in texts if text), texts


@pytest.mark.parametrize("kind", KINDS)
def test_a_prompt_ending_inside_a_character_is_not_repeated(kind: str) -> None:
    tok = load(kind)
    ids = tok.encode("Hi 中文", add_special_tokens=False).ids
    cut = next(i for i in range(1, len(ids))
               if tok.decode(ids[:i]).endswith(REPLACEMENT))  # inside 中
    texts = run(tok, ids[:cut], ids[cut:])
    assert "".join(texts) == "中文"  # vLLM: "Hi 中文" (the prompt's text repeated)


def test_a_prompt_ending_in_a_broken_byte_does_not_repeat_its_replacement_char() -> None:
    tok = load("byte_level")
    x, e4 = tok.encode("x", add_special_tokens=False).ids[0], _byte_level_id(tok, 0xE4)
    assert tok.decode([x, e4]) == "x" + REPLACEMENT
    texts = run(tok, [x, e4], tok.encode("!", add_special_tokens=False).ids)
    assert texts == ["!"]


@pytest.mark.parametrize("kind", KINDS)
def test_an_unfinished_character_at_the_end_gives_no_text_as_in_vllm(kind: str) -> None:
    tok = load(kind)
    ids = tok.encode("ok 😀", add_special_tokens=False).ids
    assert tok.decode(ids[:-1]).endswith(REPLACEMENT)  # the emoji's last byte never comes
    detok = IncrementalDetokenizer(tok, [1])
    texts = [detok.step(t) for t in ids[:-1]]
    detok.finish()
    assert detok.finished
    # vLLM 0.32: "ok" with the byte-level kind (the space came in the token " \xf0\x9f",
    # whose text never ended cleanly), "ok " with SentencePiece; never a U+FFFD.
    assert "".join(texts) == ("ok" if kind == "byte_level" else "ok ")
    with pytest.raises(RuntimeError):
        detok.step(ids[-1])


def test_a_token_holding_a_whole_character_and_an_unfinished_one_shows_neither_at_the_end(
        ) -> None:
    # vLLM 0.32 with the shipped tokenizer: "raw" for "raw" + " \xd0" (a space and a Cyrillic
    # lead byte) and for "raw" + "か\xe3\x81"; finished by a later token, the text is whole.
    tok = load("byte_level")
    raw, space_d0 = tok.token_to_id("raw"), tok.token_to_id("ĠÐ")
    ka_e3_81 = tok.token_to_id("ãģĭãģ")
    assert (tok.decode([space_d0]), tok.decode([ka_e3_81])) == (" " + REPLACEMENT,
                                                                "か" + REPLACEMENT)
    assert run(tok, [1], [raw, space_d0]) == ["raw", ""]
    assert run(tok, [1], [raw, ka_e3_81]) == ["raw", ""]
    mir = tok.encode(" мир", add_special_tokens=False).ids
    assert mir[0] == space_d0
    assert "".join(run(tok, [1], [raw, *mir])) == "raw мир"


def test_after_an_invalid_prefix_no_pending_byte_and_no_leading_space_is_lost() -> None:
    # SentencePiece byte fallback: "中" as three byte tokens, then a lone <0xE4>, then "▁a":
    # decode re-reads the whole run as invalid, DecodeStream raises "Invalid prefix".
    tok = load("sentencepiece")
    zhong = [tok.token_to_id(f"<0x{b:02X}>") for b in "中".encode()]
    space_a = tok.encode("x a", add_special_tokens=False).ids[-1]
    assert tok.id_to_token(space_a) == "▁a"
    prompt = tok.encode("x", add_special_tokens=False).ids
    texts = run(tok, prompt, [*zhong, zhong[0], space_a])
    assert texts == ["", "", "中", "", REPLACEMENT + " a"]  # vLLM: "a" (lost "\ufffd" and " ")
    assert separator_token_id(tok) is not None


def test_bad_ids_give_no_text_and_the_stream_goes_on() -> None:
    tok = load("byte_level")
    ids = tok.encode("a b", add_special_tokens=False).ids
    detok = IncrementalDetokenizer(tok, [1])
    texts = [detok.step(ids[0]), detok.step(-1), detok.step(2**40), detok.step(10**6)]
    texts += [detok.step(t) for t in ids[1:]]
    assert "".join(texts) == "a b"
    assert texts[1:4] == ["", "", ""]


@pytest.mark.parametrize("kind", KINDS)
def test_special_tokens_are_skipped_or_kept(kind: str) -> None:
    tok = load(kind)
    eos = tok.token_to_id("</s>")
    ids = tok.encode("done", add_special_tokens=False).ids
    assert "".join(run(tok, [1], [*ids, eos])) == "done"
    kept = "".join(run(tok, [1], [*ids, eos], skip_special_tokens=False))
    assert kept.endswith("</s>")


def test_without_spaces_between_special_tokens_consecutive_added_tokens_are_raw() -> None:
    # A decoder that joins tokens with spaces (WordPiece) shows vLLM's rule.
    tok = Tokenizer(models.WordLevel({"<s>": 0, "</s>": 1, "hi": 2, "[UNK]": 3}, "[UNK]"))
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens(["<s>", "</s>"])
    spaced = run(tok, [2], [0, 1, 2], skip_special_tokens=False)
    raw = run(tok, [2], [0, 1, 2], skip_special_tokens=False,
              spaces_between_special_tokens=False)
    assert spaced == [" <s>", " </s>", " hi"]
    assert raw == [" <s>", "</s>", " hi"]
    # Only with skip_special_tokens=False (vLLM's rule).
    assert run(tok, [2], [0, 1, 2], spaces_between_special_tokens=False) == ["", "", " hi"]


def _byte_level_id(tok: Tokenizer, byte: int) -> int:
    """The byte-level BPE's token for one raw byte."""
    chars = dict(zip(range(256), _bytes_to_unicode(), strict=True))
    token_id = tok.token_to_id(chars[byte])
    assert token_id is not None
    return int(token_id)


def _bytes_to_unicode() -> list[str]:
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


# -- the byte-table path (byte-level BPE) equals the DecodeStream path ----------------------

BYTE_TEXT = ("The lamp 灯塔的守护者 日本語 등대지기는 Crème brûlée 🌊🌬️ 😀👍🏽 e\u0301 "
             "\ufffd ok 中x 🙂")
BAD_IDS = (-1, -(2**40), 2**32 - 1, 2**32, 2**64)


def run_both(tok: Tokenizer, prompt: list[int], output: Sequence[object], **options: bool
             ) -> tuple[tuple[list[str], bool], tuple[list[str], bool]]:
    """(byte table, DecodeStream): every step's text, a step after the finish refused."""
    def run_one() -> tuple[list[str], bool]:
        detok = IncrementalDetokenizer(tok, prompt, **options)
        texts = [detok.step(t) for t in output]  # type: ignore[arg-type]
        detok.finish()
        try:
            detok.step(5)
        except RuntimeError:
            return texts, True
        return texts, False

    fast = run_one()
    with stream_path():
        slow = run_one()
    return fast, slow


@st.composite
def byte_level_case(draw: st.DrawFn) -> tuple[str, list[int], list[int]]:
    kind = draw(st.sampled_from(BYTE_LEVEL))
    tok = byte_level(kind)
    size = tok.get_vocab_size()
    start = draw(st.integers(0, len(BYTE_TEXT) - 1))
    ids = tok.encode(BYTE_TEXT[start:draw(st.integers(start, len(BYTE_TEXT)))],
                     add_special_tokens=False).ids
    added = sorted(tok.get_added_tokens_decoder())
    for _ in range(draw(st.integers(0, 8))):  # byte tokens, specials, added, bad ids
        ids.insert(draw(st.integers(0, len(ids))), draw(st.one_of(
            st.integers(0, size - 1), st.sampled_from(added), st.integers(size, size + 3),
            st.sampled_from(BAD_IDS))))
    cut = draw(st.integers(0, len(ids)))
    prompt = [t for t in ids[:cut] if 0 <= t < 2**32]  # decode refuses the others
    return kind, [1, *prompt] if draw(st.booleans()) else prompt, ids[cut:]


@EXAMPLES
@given(case=byte_level_case(), skip=st.booleans(), spaces=st.booleans())
def test_the_byte_table_gives_every_step_the_decode_stream_text(
        case: tuple[str, list[int], list[int]], skip: bool, spaces: bool) -> None:
    # Prompts ending inside a character, specials kept or skipped, raw added tokens, bad ids,
    # bytes pending at the end: step by step the same text as the DecodeStream path.
    kind, prompt, output = case
    tok = byte_level(kind)
    assert byte_table(tok, skip) is not None
    fast, slow = run_both(tok, prompt, output, skip_special_tokens=skip,
                          spaces_between_special_tokens=spaces)
    assert fast == slow


def test_the_byte_table_equals_the_stream_on_pinned_corners() -> None:
    tok = byte_level("added")
    ids = {t: int(tok.token_to_id(t)) for t in (*ADDED, *ADDED_SPECIAL)}  # type: ignore[arg-type]
    e4, b8 = _byte_level_id(tok, 0xE4), _byte_level_id(tok, 0xB8)
    cases: list[tuple[list[int], list[int]]] = [
        ([1], [e4, b8, ids["Ńx"], ids["Ġé"], ids["中x"]]),  # 中 completed by an added token
        ([e4], [b8, ids["Ń"], ids["<|é|>"], ids["ĠSP"], ids["🙂"]]),  # prompt inside 中
        ([e4, b8], [_byte_level_id(tok, 0xFF), ids[" sp"]]),  # the prompt's 中 never finishes
        ([], [_byte_level_id(tok, b) for b in "\ufffd".encode()] + [e4]),  # a literal U+FFFD
    ]
    for prompt, output in cases:
        for skip, spaces in itertools.product((True, False), repeat=2):
            fast, slow = run_both(tok, prompt, output, skip_special_tokens=skip,
                                  spaces_between_special_tokens=spaces)
            assert fast == slow, (prompt, output, skip, spaces)


class _Index:
    def __index__(self) -> int:
        return 70


def test_ids_of_other_types_give_what_the_stream_gives() -> None:
    tok = byte_level("shipped")
    odd: list[object] = [True, np.int64(70), np.int64(-1), _Index(), 70.0, "70", None,
                         np.uint64(2**63)]
    fast, slow = run_both(tok, [1], odd)
    assert fast == slow
    b = tok.decode([70])
    assert fast[0] == ["", b, "", b, "", "", "", ""]  # True is id 1 (<s>, skipped)


def test_the_byte_table_decodes_every_id_as_the_library_does() -> None:
    for kind in BYTE_LEVEL:
        tok = byte_level(kind)
        for skip in (True, False):
            table = byte_table(tok, skip)
            assert table is not None
            for token_id in [*range(len(table) + 3), 2**32 - 1, 2**32, 2**64]:
                raw = table.fill(token_id)
                decoded = tok.decode([token_id], skip_special_tokens=skip) \
                    if token_id < 2**32 else ""
                assert raw.decode("utf-8", "replace") == decoded, (kind, skip, token_id)
                if token_id < len(table):
                    assert table.raw[token_id] == raw
                    assert table.texts[token_id] == \
                        (None if decoded.endswith(REPLACEMENT) else decoded)


@settings(max_examples=300, derandomize=True, deadline=None, database=None)
@given(data=st.binary(max_size=16))
def test_python_replace_decoding_is_the_libraries_lossy_decoding(data: bytes) -> None:
    # The byte table decodes with Python's "replace"; tokenizers with Rust's from_utf8_lossy:
    # both replace maximal subparts (surrogates, overlongs, truncated and stray bytes).
    assert _raw_bytes_tokenizer().decode(list(data)) == data.decode("utf-8", "replace")


def test_python_replace_decoding_is_the_libraries_on_every_short_tricky_sequence() -> None:
    tricky = [0x41, 0x80, 0xBF, 0xC0, 0xC2, 0xE0, 0xED, 0xEF, 0xF0, 0xF4, 0xF5, 0x9F, 0xA0,
              0x8F, 0x90]
    tok = _raw_bytes_tokenizer()
    for length in (1, 2, 3):
        for seq in itertools.product(tricky, repeat=length):
            assert tok.decode(list(seq)) == bytes(seq).decode("utf-8", "replace"), seq


def test_only_a_plain_byte_level_decoder_gets_a_table_and_a_changed_tokenizer_a_new_one(
        ) -> None:
    shipped = byte_level("shipped")
    assert byte_table(shipped, True) is byte_table(shipped, True)
    assert byte_table(load("sentencepiece"), True) is None
    wrapped = Tokenizer.from_str(shipped.to_str())
    wrapped.decoder = decoders.Sequence([decoders.ByteLevel()])
    assert byte_table(wrapped, True) is None
    grown = Tokenizer.from_str(shipped.to_str())
    before = byte_table(grown, True)
    grown.add_tokens(["ẞtraße"])
    new_id = grown.token_to_id("ẞtraße")
    assert before is not None and new_id is not None and len(before) <= new_id
    assert "".join(run(grown, [1], [new_id])) == "ẞtraße"


def _raw_bytes_tokenizer() -> Tokenizer:
    """A byte-level tokenizer whose id ``b`` is the one byte ``b``."""
    tok = Tokenizer(models.BPE(vocab={c: b for b, c in enumerate(_bytes_to_unicode())},
                               merges=[]))
    tok.decoder = decoders.ByteLevel()
    return tok


class _CountingStream:
    """The library's ``DecodeStream``, counting its steps."""

    steps = 0

    def __init__(self, *args: object, **kwargs: object) -> None:
        self._stream = DecodeStream(*args, **kwargs)  # type: ignore[arg-type]

    def step(self, tokenizer: Tokenizer, token_id: int) -> str | None:
        _CountingStream.steps += 1
        return self._stream.step(tokenizer, token_id)  # type: ignore[no-any-return]


@pytest.mark.parametrize("kind", KINDS)
def test_a_run_of_skipped_special_tokens_does_not_step_the_library_stream(kind: str) -> None:
    # Kept in the stream's window, each skipped token made every later step decode a longer
    # one: 4,000 <unk> from a model cost 0.5 s, 16,000 eight seconds, on the event loop.
    tok = load(kind)
    unk = min(i for i, t in tok.get_added_tokens_decoder().items()
              if t.special and t.content not in ("<s>", "</s>"))  # <unk> or <pad>
    eos = tok.token_to_id("</s>")
    ids = tok.encode("Crème 灯塔 done", add_special_tokens=False).ids
    output = [ids[0], *[unk] * 2000, *ids[1:], eos, *[unk] * 2000]
    with stream_path(), mock.patch.object(detokenizer_module, "DecodeStream", _CountingStream):
        _CountingStream.steps = 0
        texts = run(tok, [1], output)
        assert _CountingStream.steps == len(ids)
        kept = run(tok, [1], output[:3], skip_special_tokens=False)
    assert "".join(texts) == reference_text(tok, [1], output, True)
    assert "".join(kept) == reference_text(tok, [1], output[:3], False)
    assert tok.id_to_token(unk) in "".join(kept)


@pytest.mark.parametrize("kind", KINDS)
@EXAMPLES
@given(data=st.data())
def test_skipped_special_tokens_anywhere_give_the_library_streams_steps(
        kind: str, data: st.DataObject) -> None:
    tok = load(kind)
    specials = sorted(i for i, t in tok.get_added_tokens_decoder().items() if t.special)
    ids = tok.encode(data.draw(st.sampled_from(sorted(SCRIPTS.values()))),
                     add_special_tokens=False).ids
    for _ in range(data.draw(st.integers(1, 8))):
        ids.insert(data.draw(st.integers(0, len(ids))), data.draw(st.sampled_from(specials)))
    library = DecodeStream(ids=[1], skip_special_tokens=True)
    expected = [library.step(tok, t) or "" for t in ids]
    with stream_path():
        assert run(tok, [1], ids)[:len(ids)] == expected
