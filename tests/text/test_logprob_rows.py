"""Logprob rows held flat (:class:`LogprobRows`): they read as the list of rows they stand
for (index, slice, iterate, compare, join), and a whole generation's logprobs add no object
per entry for the garbage collector to walk.

Before, each entry was a :class:`TokenLogprob` and each row a list: 16 choices of 4,000
tokens with 20 logprobs each made 1.3 million tracked objects, which every full collection
walked while the event loop waited, as a whole response was gathered."""

from __future__ import annotations

import gc

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from anyio_genout import LogprobRows, SamplingParams, TextRequest, TokenLogprob
from anyio_genout.text.output import TextOutput, merge_outputs
from tests.text.client_support import text_client

pytestmark = pytest.mark.anyio


def _as_lists(width: int, ids: list[int], ranks: list[int]) -> list[list[TokenLogprob]]:
    """The rows as objects, built the way they were before."""
    return [[TokenLogprob(ids[r * width + c], -0.5 * c, ranks[r] if c == 0 else c,
                          f"t{ids[r * width + c]}") for c in range(width)]
            for r in range(len(ranks))]


def _flat(width: int, ids: list[int], ranks: list[int]) -> LogprobRows:
    return LogprobRows(width, ids, [-0.5 * (i % width) for i in range(len(ids))], ranks,
                       [f"t{i}" for i in ids])


@st.composite
def _shapes(draw: st.DrawFn) -> tuple[int, list[int], list[int]]:
    width = draw(st.integers(1, 4))
    count = draw(st.integers(0, 6))
    ids = draw(st.lists(st.integers(0, 99), min_size=width * count, max_size=width * count))
    ranks = draw(st.lists(st.integers(1, 50), min_size=count, max_size=count))
    return width, ids, ranks


@settings(derandomize=True, max_examples=300)
@given(_shapes(), st.integers(-8, 8), st.integers(-8, 8), st.sampled_from([None, 1, 2, -1, 3]))
@example((2, [1, 2, 3, 4], [1, 7]), -1, 0, -1)
def test_flat_rows_read_as_the_list_of_rows(shape: tuple[int, list[int], list[int]],
                                            start: int, stop: int, step: int | None) -> None:
    width, ids, ranks = shape
    flat, rows = _flat(width, ids, ranks), _as_lists(width, ids, ranks)
    assert len(flat) == len(rows) and bool(flat) == bool(rows)
    assert list(flat) == rows and flat == rows and rows == flat
    for i in range(-len(rows), len(rows)):
        assert flat[i] == rows[i]
    for i in (len(rows), -len(rows) - 1):
        with pytest.raises(IndexError):
            flat[i]
    assert flat[start:stop:step] == rows[start:stop:step]
    assert isinstance(flat[start:stop:step], LogprobRows)
    assert flat + flat == rows + rows and rows + flat == rows + rows
    assert isinstance(flat + flat, LogprobRows)


def test_joined_rows_keep_their_order_and_mixed_widths_become_a_list() -> None:
    a, b = _flat(2, [1, 2, 3, 4], [1, 5]), _flat(2, [5, 6], [2])
    wide = _flat(3, [7, 8, 9], [1])
    joined = LogprobRows.join([a, LogprobRows(0, [], [], [], []), b])
    assert isinstance(joined, LogprobRows) and joined == list(a) + list(b)
    mixed = LogprobRows.join([a, wide])
    assert type(mixed) is list and mixed == list(a) + list(wide)
    assert LogprobRows.join([]) == [] and LogprobRows.join([a]) is a
    # Merged outputs (a consumer that fell behind) join their rows the same way.
    merged = merge_outputs([TextOutput("r", "x", [1, 3], a), TextOutput("r", "y", [5], b)])
    assert merged.logprobs == list(a) + list(b) and merged.text == "xy"


async def test_a_whole_generation_with_logprobs_adds_no_object_per_entry() -> None:
    tokens, top = 2000, 20
    async with text_client() as setup:
        gc.collect()
        before = len(gc.get_objects())
        async with setup.text.generate(TextRequest(
                prompt="Once upon a time", sampling_params=SamplingParams(
                    max_tokens=tokens, logprobs=top, ignore_eos=True))) as stream:
            whole = await stream.collect_text()
        gc.collect()
        added = len(gc.get_objects()) - before
    assert whole.logprobs is not None and len(whole.logprobs) == tokens
    assert len(whole.logprobs[-1]) == top + 1
    entries = tokens * (top + 1)
    # Before: an object per entry and a list per row (42,000 here, and more).
    assert added < entries / 10, f"{added} objects tracked for {entries} logprob entries"
