"""Stop strings: vLLM's matching rules and hold-back (anyio_genout/text/stop_strings.py)."""

from __future__ import annotations

import pytest

from anyio_genout.errors import InvalidRequestError
from anyio_genout.text.stop_strings import StopMatch, StopStrings


def test_the_match_that_completes_earliest_wins_not_the_first_listed() -> None:
    stops = StopStrings(("brown fox", "quick"))
    assert stops.search("the quick brown fox", 0) == StopMatch("quick", 4, 9)


def test_a_tie_goes_to_the_stop_string_listed_first() -> None:
    assert StopStrings(("fox", "x")).search("a fox", 0) == StopMatch("fox", 2, 5)
    assert StopStrings(("x", "fox")).search("a fox", 0) == StopMatch("x", 4, 5)


def test_a_match_must_end_in_the_new_text_and_may_start_before_it() -> None:
    stops = StopStrings(("END",))
    assert stops.search("the EN" + "D!", 6) == StopMatch("END", 4, 7)  # split across steps
    assert stops.search("END and more", 4) is None  # already seen before the new text
    assert stops.search("abc", 3) is None  # no new text


def test_the_text_is_cut_at_the_match_or_after_it_when_included() -> None:
    match = StopMatch("END", 4, 7)
    assert StopStrings(("END",)).cut(match) == 4
    assert StopStrings(("END",), include_in_output=True).cut(match) == 7


def test_hold_back_is_the_longest_stop_less_one_unless_included() -> None:
    assert StopStrings(("a", "four")).hold_back == 3
    assert StopStrings(("a", "four"), include_in_output=True).hold_back == 0
    assert StopStrings(()).hold_back == 0
    assert StopStrings("four").stops == ("four",)  # a str is one stop string


@pytest.mark.parametrize("stop", [("ok", ""), ("ok", 3)])
def test_bad_stop_strings_are_refused_naming_the_field(stop: tuple[object, ...]) -> None:
    with pytest.raises(InvalidRequestError) as info:
        StopStrings(stop)  # type: ignore[arg-type]
    assert info.value.field == "stop"
