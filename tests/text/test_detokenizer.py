"""IncrementalDetokenizer: vLLM's incremental text, right in vLLM's three wrong corners.

The guarantee tested (see anyio_genout/text/detokenizer.py and
``tests.text.tokenizer_kinds.reference_text``): the texts of all steps plus ``flush()`` are the
full decode's text after the prompt's, whenever decode never rewrites text it produced (always
for byte-level BPE; for byte fallback as long as no byte run turns invalid).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models

from anyio_genout.text.detokenizer import IncrementalDetokenizer, separator_token_id
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
        ) -> tuple[list[str], str]:
    detok = IncrementalDetokenizer(tok, prompt, **options)
    texts = [detok.step(t) for t in output]
    return texts, detok.flush()


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
def test_steps_and_flush_spell_the_decoded_text_in_every_script(
        kind: str, data: st.DataObject, skip: bool) -> None:
    # Byte-level decode never rewrites its text, so any ids hold; for the SentencePiece kind
    # the ids are those of real text (its byte runs are valid UTF-8).
    tok = load(kind)
    prompt, output = data.draw(prompt_and_output(kind, noise=kind == "byte_level"))
    texts, rest = run(tok, prompt, output, skip_special_tokens=skip)
    assert "".join(texts) + rest == reference_text(tok, prompt, output, skip)
    assert all(not text.endswith(REPLACEMENT) for text in texts if text), texts


@pytest.mark.parametrize("kind", KINDS)
def test_a_prompt_ending_inside_a_character_is_not_repeated(kind: str) -> None:
    tok = load(kind)
    ids = tok.encode("Hi 中文", add_special_tokens=False).ids
    cut = next(i for i in range(1, len(ids))
               if tok.decode(ids[:i]).endswith(REPLACEMENT))  # inside 中
    texts, rest = run(tok, ids[:cut], ids[cut:])
    assert "".join(texts) + rest == "中文"  # vLLM: "Hi 中文" (the prompt's text repeated)


def test_a_prompt_ending_in_a_broken_byte_does_not_repeat_its_replacement_char() -> None:
    tok = load("byte_level")
    x, e4 = tok.encode("x", add_special_tokens=False).ids[0], _byte_level_id(tok, 0xE4)
    assert tok.decode([x, e4]) == "x" + REPLACEMENT
    texts, rest = run(tok, [x, e4], tok.encode("!", add_special_tokens=False).ids)
    assert (texts, rest) == (["!"], "")


@pytest.mark.parametrize("kind", KINDS)
def test_bytes_pending_at_the_end_are_flushed_not_dropped(kind: str) -> None:
    tok = load(kind)
    ids = tok.encode("ok 😀", add_special_tokens=False).ids
    detok = IncrementalDetokenizer(tok, [1])
    texts = [detok.step(t) for t in ids[:-1]]  # the emoji's last byte never comes
    rest = detok.flush()
    assert rest.endswith(REPLACEMENT)  # vLLM drops it
    assert "".join(texts) + rest == tok.decode(ids[:-1])
    assert REPLACEMENT not in "".join(texts)
    assert detok.flush() == ""
    with pytest.raises(RuntimeError):
        detok.step(ids[-1])


def test_after_an_invalid_prefix_no_pending_byte_and_no_leading_space_is_lost() -> None:
    # SentencePiece byte fallback: "中" as three byte tokens, then a lone <0xE4>, then "▁a":
    # decode re-reads the whole run as invalid, DecodeStream raises "Invalid prefix".
    tok = load("sentencepiece")
    zhong = [tok.token_to_id(f"<0x{b:02X}>") for b in "中".encode()]
    space_a = tok.encode("x a", add_special_tokens=False).ids[-1]
    assert tok.id_to_token(space_a) == "▁a"
    prompt = tok.encode("x", add_special_tokens=False).ids
    texts, rest = run(tok, prompt, [*zhong, zhong[0], space_a])
    assert texts == ["", "", "中", "", REPLACEMENT + " a"]  # vLLM: "a" (lost "\ufffd" and " ")
    assert rest == ""
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
    assert "".join(run(tok, [1], [*ids, eos])[0]) == "done"
    kept = "".join(run(tok, [1], [*ids, eos], skip_special_tokens=False)[0])
    assert kept.endswith("</s>")


def test_without_spaces_between_special_tokens_consecutive_added_tokens_are_raw() -> None:
    # A decoder that joins tokens with spaces (WordPiece) shows vLLM's rule.
    tok = Tokenizer(models.WordLevel({"<s>": 0, "</s>": 1, "hi": 2, "[UNK]": 3}, "[UNK]"))
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens(["<s>", "</s>"])
    spaced = run(tok, [2], [0, 1, 2], skip_special_tokens=False)[0]
    raw = run(tok, [2], [0, 1, 2], skip_special_tokens=False,
              spaces_between_special_tokens=False)[0]
    assert spaced == [" <s>", " </s>", " hi"]
    assert raw == [" <s>", "</s>", " hi"]
    # Only with skip_special_tokens=False (vLLM's rule).
    assert run(tok, [2], [0, 1, 2], spaces_between_special_tokens=False)[0] == ["", "", " hi"]


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
