"""TextDecoder: one request's text with stop strings and min_tokens, as vLLM 0.32 does it."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from anyio_genout.errors import InvalidRequestError
from anyio_genout.generate import FinishReason
from anyio_genout.text import TextDecoder, TextStep, bundled_tokenizer
from tests.text.byte_level_kinds import BYTE_LEVEL, byte_level, stream_path
from tests.text.tokenizer_kinds import KINDS, load, reference_text

EXAMPLES = settings(max_examples=120, derandomize=True, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow])
REPLACEMENT = "\ufffd"
TEXT = "Fog from noon, 霧が出た 🌫️; horn sounded four hours. No ships seen. Fin."


def tokens(kind: str, text: str) -> list[int]:
    return list(load(kind).encode(text, add_special_tokens=False).ids)


def feed(decoder: TextDecoder, steps: Sequence[Sequence[int]], *,
         stop_terminated: bool = False) -> list[TextStep]:
    """Feed the steps; the last one finishes the request (unless a stop string ends it):
    stopped on EOS with ``stop_terminated``, else on its length."""
    out = []
    finish = FinishReason.stop_eos() if stop_terminated else FinishReason.LENGTH
    for i, step in enumerate(steps):
        final = i == len(steps) - 1
        out.append(decoder.update(step, finish if final else None))
        if out[-1].stop_string:
            break
    return out


def one_by_one(ids: Sequence[int]) -> list[list[int]]:
    return [[t] for t in ids]


def char_tokens(tok: Tokenizer, text: str) -> list[int]:
    """One token per character (plain ASCII text), so char offsets are token offsets."""
    ids = [tok.encode(c, add_special_tokens=False).ids for c in text]
    assert all(len(i) == 1 for i in ids)
    return [i[0] for i in ids]


def test_stop_strings_are_held_back_while_streaming_and_cut_on_a_match() -> None:
    tok = load("byte_level")
    decoder = TextDecoder(tok, [1], stop=("END", "ND!"))
    steps = feed(decoder, one_by_one(char_tokens(tok, "the END! more")))
    assert [s.text for s in steps] == ["", "", "t", "h", "e", " ", ""]
    assert steps[-1] == TextStep("", 1, "END", FinishReason.stop("END"))  # before "ND!"
    assert not any(s.finished for s in steps[:-1]) and steps[-1].finished
    assert steps[-1].stop_reason == "END"
    assert decoder.text == "the "
    with pytest.raises(RuntimeError):
        decoder.update([5])


def test_with_include_stop_str_in_output_nothing_is_held_and_the_match_is_kept() -> None:
    tok = load("byte_level")
    decoder = TextDecoder(tok, [1], stop=("END",), include_stop_str_in_output=True)
    steps = feed(decoder, one_by_one(char_tokens(tok, "the END! more")))
    assert "".join(s.text for s in steps) == decoder.text == "the END"
    assert steps[-1].stop_string == "END"


def test_in_one_step_of_several_tokens_the_earliest_match_wins_and_later_ids_drop() -> None:
    tok = load("byte_level")
    ids = char_tokens(tok, "a fox jumps")
    decoder = TextDecoder(tok, [1], stop=("jumps", "fox"))
    step = decoder.update(ids)
    assert step == TextStep("a ", 5, "fox", FinishReason.stop("fox"))  # " jumps" dropped
    assert decoder.text == "a "


def test_stop_strings_wait_for_min_tokens_and_a_match_may_straddle_the_border() -> None:
    tok = load("byte_level")
    ids = char_tokens(tok, "ab ab ab")
    early = TextDecoder(tok, [1], stop=("ab",), min_tokens=3)
    assert feed(early, one_by_one(ids))[-1] == TextStep("", 1, "ab", FinishReason.stop("ab"))
    assert early.text == "ab "  # the "ab" inside the first 3 tokens is ignored
    straddle = TextDecoder(tok, [1], stop=("b a",), min_tokens=2)
    steps = feed(straddle, one_by_one(ids))
    assert straddle.text == "a" and steps[-1].stop_string == "b a"  # starts at token 1


def test_a_stop_terminated_last_token_is_not_detokenized_unless_included() -> None:
    tok = load("byte_level")
    ids = char_tokens(tok, "done!")
    plain = TextDecoder(tok, [1], skip_special_tokens=False)
    assert feed(plain, [ids], stop_terminated=True) == [
        TextStep("done", 5, None, FinishReason.STOP)]
    shown = TextDecoder(tok, [1], include_stop_str_in_output=True)
    assert feed(shown, [ids], stop_terminated=True) == [
        TextStep("done!", 5, None, FinishReason.STOP)]


def test_the_finish_sends_the_held_text_but_no_unfinished_character() -> None:
    tok = load("byte_level")
    ids = tokens("byte_level", "ok 😀")
    assert tok.decode(ids[:-1]) == "ok " + REPLACEMENT
    decoder = TextDecoder(tok, [1], stop=("zzzz",))
    steps = feed(decoder, [*one_by_one(ids[:-2]), ids[-2:-1]])  # the last byte never comes
    # vLLM's text: the space came in the token " \xf0\x9f", whose text never ended cleanly.
    assert "".join(s.text for s in steps) == decoder.text == "ok"
    assert [s.keep for s in steps] == [1] * (len(ids) - 1)


#: (prompt, steps, options, each step's (text, stop string), the text, the kept ids): what
#: vLLM 0.32's own detokenizer (``FastIncrementalDetokenizer`` + ``get_next_output_text``,
#: driven as its output processor drives them) gives with the shipped tokenizer. The last
#: step finishes the request (on EOS with ``terminated``, else on its length). 165 is the
#: lone byte E4 (a 3-byte lead), 121 the byte B8, 305 " \xd0" (a space and a Cyrillic lead
#: byte), 479 " are", 542 "raw", 464 "ind", 1003 "You", 2 "</s>" (EOS).
VLLM_FINISHES = {
    # The serve differential's prompt [1, 5, 6], max_tokens 8: vLLM "\ufffd arerawindYouraw",
    # this layer was "...raw\ufffd". Its output ids are not in the differential's answers:
    # these ones spell the same text (a lead byte cut by " are", then an unfinished 中).
    "serve-differential": (
        [1, 5, 6], [[165], [479], [542], [464], [1003], [542], [165], [121]], {},
        [("", None), ("\ufffd are", None), ("raw", None), ("ind", None), ("You", None),
         ("raw", None), ("", None), ("", None)],
        "\ufffd arerawindYouraw", [165, 479, 542, 464, 1003, 542, 165, 121]),
    "serve-differential-one-step": (
        [1, 5, 6], [[165, 479, 542, 464, 1003, 542, 165, 121]], {},
        [("\ufffd arerawindYouraw", None)], "\ufffd arerawindYouraw",
        [165, 479, 542, 464, 1003, 542, 165, 121]),
    "an-empty-last-step": (
        [1, 5, 6], [[542], [165], []], {}, [("raw", None), ("", None), ("", None)],
        "raw", [542, 165]),
    "held-back-for-a-stop-string": (
        [1, 5, 6], [[542], [464], [165]], {"stop": ("zzzz",)},
        [("", None), ("raw", None), ("ind", None)], "rawind", [542, 464, 165]),
    "stop-string-included": (
        [1, 5, 6], [[542], [464], [165]], {"stop": ("zzzz",), "include": True},
        [("raw", None), ("ind", None), ("", None)], "rawind", [542, 464, 165]),
    "a-match-in-the-last-step": (
        [1, 5, 6], [[542], [464, 165]], {"stop": ("ind",)},
        [("r", None), ("aw", "ind")], "raw", [542, 464]),
    "no-match-on-a-space-that-never-shows": (
        [1, 5, 6], [[542], [305]], {"stop": ("w ",)},
        [("ra", None), ("w", None)], "raw", [542, 305]),
    "no-match-on-a-space-that-never-shows-included": (
        [1, 5, 6], [[542], [305]], {"stop": ("w ",), "include": True},
        [("raw", None), ("", None)], "raw", [542, 305]),
    "eos-after-an-unfinished-character": (
        [1, 5, 6], [[542], [165], [2]], {"terminated": True},
        [("raw", None), ("", None), ("", None)], "raw", [542, 165, 2]),
    "eos-included-and-skipped": (
        [1, 5, 6], [[542], [165], [2]], {"terminated": True, "include": True},
        [("raw", None), ("", None), ("", None)], "raw", [542, 165, 2]),
    "eos-included-and-kept-ends-the-character": (
        [1, 5, 6], [[542], [165], [2]], {"terminated": True, "include": True, "skip": False},
        [("raw", None), ("", None), ("\ufffd</s>", None)], "raw\ufffd</s>", [542, 165, 2]),
    "min-tokens-then-eos": (
        [1, 5, 6], [[542], [464], [165, 2]], {"terminated": True, "min_tokens": 3,
                                              "stop": ("raw",)},
        [("r", None), ("awi", None), ("nd", None)], "rawind", [542, 464, 165, 2]),
    "min-tokens-then-a-match-before-the-unfinished-character": (
        [1, 5, 6], [[542], [464], [542, 165]], {"min_tokens": 2, "stop": ("raw",)},
        [("r", None), ("awi", None), ("nd", "raw")], "rawind", [542, 464, 542]),
    "min-tokens-included-eos": (
        [1], [[542, 464], [165, 2]], {"terminated": True, "include": True, "min_tokens": 1,
                                      "stop": ("d",)},
        [("rawind", "d")], "rawind", [542, 464]),
}


@pytest.mark.parametrize("name", sorted(VLLM_FINISHES))
def test_the_finish_gives_what_vllm_gives_for_an_unfinished_character(name: str) -> None:
    prompt, steps, options, expected_steps, expected_text, expected_kept = VLLM_FINISHES[name]
    decoder = TextDecoder(load("byte_level"), prompt, stop=options.get("stop", ()),
                          include_stop_str_in_output=bool(options.get("include", False)),
                          min_tokens=int(options.get("min_tokens", 0)),
                          skip_special_tokens=bool(options.get("skip", True)))
    got = feed(decoder, steps, stop_terminated=bool(options.get("terminated", False)))
    assert [(g.text, g.stop_string) for g in got] == expected_steps
    assert decoder.text == expected_text
    assert [t for s, g in zip(steps, got, strict=False) for t in s[:g.keep]] == expected_kept
    assert got[-1].finished


def test_without_detokenize_there_is_no_text_and_stop_strings_are_refused() -> None:
    tok = load("byte_level")
    decoder = TextDecoder(tok, [1], detokenize=False)
    assert decoder.update([40, 41], FinishReason.STOP) == \
        TextStep("", 2, None, FinishReason.STOP)
    with pytest.raises(InvalidRequestError) as info:
        TextDecoder(tok, [1], stop=("x",), detokenize=False)
    assert info.value.field == "stop"
    with pytest.raises(InvalidRequestError):
        TextDecoder(tok, [1], stop=("",))


@st.composite
def split_request(draw: st.DrawFn, kind: str) -> tuple[list[int], list[list[int]]]:
    ids = tokens(kind, TEXT[draw(st.integers(0, 40)):])
    start = draw(st.integers(0, len(ids) - 1))
    prompt, output = [1, *ids[:start]], ids[start:]
    cuts = sorted(draw(st.lists(st.integers(0, len(output) - 1), max_size=len(output))))
    bounds = [0, *cuts, len(output)]
    return prompt, [output[a:b] for a, b in itertools.pairwise(bounds)]


@pytest.mark.parametrize("kind", KINDS)
@EXAMPLES
@given(data=st.data(), stop=st.lists(st.sampled_from(["o", "ho", "s.", "霧が", "🌫", "zz"]),
                                     max_size=2),
       include=st.booleans(), min_tokens=st.integers(0, 4), terminated=st.booleans())
def test_the_result_is_the_same_for_every_split_into_steps(
        kind: str, data: st.DataObject, stop: list[str], include: bool, min_tokens: int,
        terminated: bool) -> None:
    tok = load(kind)
    prompt, steps = data.draw(split_request(kind))
    output = [t for s in steps for t in s]

    def decode(steps: Sequence[Sequence[int]]) -> tuple[str, list[int], str | None]:
        decoder = TextDecoder(tok, prompt, stop=stop, include_stop_str_in_output=include,
                              min_tokens=min_tokens)
        got = feed(decoder, steps, stop_terminated=terminated)
        kept = [t for s, g in zip(steps, got, strict=False) for t in s[:g.keep]]
        assert "".join(g.text for g in got) == decoder.text
        return decoder.text, kept, got[-1].stop_string

    text, kept, matched = decode(steps)
    assert (text, kept, matched) == decode(one_by_one(output))
    if matched is None:
        detokenized = output[:-1] if terminated and not include else output
        assert text == reference_text(tok, prompt, detokenized, True)
        assert kept == output
    elif not include:
        assert all(s not in text for s in stop) or min_tokens > 0


# -- byte-level tokenizers: the byte table's steps equal the DecodeStream path's ------------

LONG = ("Fog from noon, 霧が出た 🌫️; horn sounded four hours. No ships seen. Fin. " * 4
        + "Crème brûlée 灯塔 😀👍🏽 END: over.")


@st.composite
def byte_level_request(draw: st.DrawFn) -> tuple[str, list[int], list[list[int]], list[str]]:
    kind = draw(st.sampled_from(BYTE_LEVEL))
    tok = byte_level(kind)
    start = draw(st.integers(0, len(LONG) - 1))
    ids = tok.encode(LONG[start:], add_special_tokens=False).ids
    added = sorted(tok.get_added_tokens_decoder())
    for _ in range(draw(st.integers(0, 6))):  # specials, added tokens, bytes, bad ids
        ids.insert(draw(st.integers(0, len(ids))), draw(st.one_of(
            st.sampled_from(added), st.integers(0, tok.get_vocab_size() + 2),
            st.sampled_from([-1, 2**32]))))
    cut = draw(st.integers(0, len(ids) - 1))
    prompt = [t for t in ids[:cut] if 0 <= t < 2**32]
    output = ids[cut:]
    cuts = sorted(draw(st.lists(st.integers(0, len(output) - 1), max_size=len(output))))
    steps = [output[a:b] for a, b in itertools.pairwise([0, *cuts, len(output)])]
    text = tok.decode([t for t in output if 0 <= t < 2**32])
    taken = [text[i:i + n] for i, n in draw(st.lists(
        st.tuples(st.integers(0, max(len(text) - 1, 0)), st.integers(1, 4)), max_size=2))]
    stop = [s for s in taken if s] + draw(st.lists(st.sampled_from(
        ["END:", "zz", "。", "\ufffd", "<|é|>", " sp"]), max_size=2))
    return kind, prompt, steps, stop


@EXAMPLES
@given(request=byte_level_request(), include=st.booleans(), min_tokens=st.integers(0, 4),
       terminated=st.booleans(), skip=st.booleans(), spaces=st.booleans(),
       one_by_one_too=st.booleans())
def test_byte_level_text_steps_equal_the_decode_stream_paths(
        request: tuple[str, list[int], list[list[int]], list[str]], include: bool,
        min_tokens: int, terminated: bool, skip: bool, spaces: bool,
        one_by_one_too: bool) -> None:
    # Every TextStep (text after hold-back, kept ids, stop string) and the whole text, with
    # and without stop strings, are those of the DecodeStream path.
    kind, prompt, steps, stop = request
    tok = byte_level(kind)
    if one_by_one_too:
        steps = one_by_one([t for s in steps for t in s])

    def decode(stops: list[str]) -> tuple[list[TextStep], str]:
        decoder = TextDecoder(tok, prompt, stop=stops, include_stop_str_in_output=include,
                              min_tokens=min_tokens, skip_special_tokens=skip,
                              spaces_between_special_tokens=spaces)
        return feed(decoder, steps, stop_terminated=terminated), decoder.text

    for stops in ([], stop):
        fast = decode(stops)
        with stream_path():
            slow = decode(stops)
        assert fast == slow


def test_a_long_held_back_text_streams_the_same_one_token_at_a_time_as_at_once() -> None:
    # The one-token path keeps the held-back text in a buffer it trims now and then; the
    # text, the hold-back and a late match are those of the general path.
    tok = load("byte_level")
    ids = tokens("byte_level", LONG)
    for stop in (("zzzz", "qq"), ("END:",), ("灯塔",)):
        decoder = TextDecoder(tok, [1], stop=stop)
        steps = feed(decoder, [*one_by_one(ids), []])
        whole = TextDecoder(tok, [1], stop=stop)
        at_once = feed(whole, [ids, []])
        assert "".join(s.text for s in steps) == "".join(s.text for s in at_once) == \
            decoder.text == whole.text
        assert steps[-1].stop_string == at_once[-1].stop_string
        assert sum(s.keep for s in steps) == sum(s.keep for s in at_once)
        streamed = "".join(s.text for s in steps[:-1])
        if steps[-1].stop_string is None:
            assert decoder.text == tok.decode(ids)
            assert len(streamed) == len(decoder.text) - (max(map(len, stop)) - 1)
        else:
            assert decoder.text == LONG[:LONG.index(stop[0])]


# -- the decoder alone: built from the project's Tokenizer, every step a TextStep -----------

def test_the_decoder_takes_the_projects_tokenizer_and_its_backend_alike() -> None:
    tokenizer = bundled_tokenizer()
    ids = tokenizer.encode("Once upon a time, the end. More.", add_special_tokens=False)
    texts = []
    for accepted in (tokenizer, tokenizer.backend):
        decoder = TextDecoder(accepted, [1], stop=("the end",))
        steps = []
        for token_id in ids:
            steps.append(decoder.push(token_id))
            if steps[-1].finished:
                break
        texts.append(("".join(s.text for s in steps), decoder.text, steps[-1].finish_reason))
    assert texts[0] == texts[1]
    assert texts[0][:2] == ("Once upon a time, ", "Once upon a time, ")
    assert texts[0][2] == FinishReason.stop("the end")
    with pytest.raises(TypeError, match=r"tokenizer must be an anyio_genout\.text\.Tokenizer"):
        TextDecoder("gpt2", [1])  # type: ignore[arg-type]


@pytest.mark.parametrize(("stops", "include"), [((), False), (("zzzz",), False),
                                               (("zzzz",), True)], ids=["plain", "held", "shown"])
def test_push_returns_a_running_step_until_the_finish(stops: tuple[str, ...],
                                                     include: bool) -> None:
    tok = load("byte_level")
    decoder = TextDecoder(tok, [1], stop=stops, include_stop_str_in_output=include)
    ids = char_tokens(tok, "plain text")
    steps = [decoder.push(t) for t in ids]
    assert all(type(s) is TextStep and not s.finished and s.finish_reason is None
               and s.stop_reason is None and s.keep == 1 for s in steps)
    last = decoder.update([], FinishReason.LENGTH)
    assert last.finished and last.finish_reason == FinishReason.LENGTH
    assert last.stop_reason is None and decoder.finished
    assert "".join(s.text for s in [*steps, last]) == decoder.text == "plain text"


@pytest.mark.parametrize(("finish", "last_is_text"), [
    (FinishReason.stop_eos(), False),          # EOS: not text
    (FinishReason.stop(7), False),             # a stop token id: not text
    (FinishReason.stop("!"), True),            # a stop string the engine matched: text
    (FinishReason.stop((33, 34)), True),       # a stop token sequence (the client's)
    (FinishReason.LENGTH, True),
    (FinishReason.ABORT, True),
])
def test_the_finish_reason_decides_whether_the_last_token_is_text(
        finish: FinishReason, last_is_text: bool) -> None:
    tok = load("byte_level")
    ids = char_tokens(tok, "done!")
    step = TextDecoder(tok, [1]).update(ids, finish)
    assert step.text == ("done!" if last_is_text else "done")
    assert step.keep == 5 and step.finish_reason == finish and step.finished
    assert step.stop_reason == finish.stop_reason
    shown = TextDecoder(tok, [1], include_stop_str_in_output=True).update(ids, finish)
    assert shown.text == "done!"


def test_a_match_in_the_terminal_output_replaces_the_engines_finish() -> None:
    tok = load("byte_level")
    ids = char_tokens(tok, "one. two")
    step = TextDecoder(tok, [1], stop=(".",)).update(ids, FinishReason.LENGTH)
    assert step == TextStep("one", 4, ".", FinishReason.stop("."))
