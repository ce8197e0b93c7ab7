"""``EngineCoreOutputStream.take_plain``: the run of plain steps at the head of the buffer,
taken in one call by the generate layer's coalescing. Its fast path (everything buffered is
a plain row: one pass over the types and a copy) must take exactly what the step-by-step
rule takes: the pairs at the head whose output brings tokens alone, at most ``limit``."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from anyio_genout import EngineCoreRequest, SamplingParams
from anyio_genout.engine.mailbox import OutputMailbox
from anyio_genout.engine.pace import ReaderPace
from anyio_genout.engine.stream import new_output_stream
from anyio_genout.protocol import EngineCoreFinishReason, EngineCoreOutput
from anyio_genout.protocol.outputs import PLAIN_NONES


def _row(tokens: list[int]) -> list[Any]:
    """A plain row as the reader buffers it: the output's fields in order, a list."""
    return list(EngineCoreOutput("r", tokens))


_ITEM = st.one_of(
    st.builds(_row, st.lists(st.integers(0, 9), max_size=3)),  # a plain row
    st.builds(lambda t: EngineCoreOutput("r", t), st.lists(st.integers(0, 9), max_size=3)),
    st.builds(lambda t: EngineCoreOutput("r", t, finish_reason=EngineCoreFinishReason.LENGTH),
              st.lists(st.integers(0, 9), max_size=3)),
)


def _reference(items: list[Any], limit: int) -> list[Any]:
    """The rule, one step at a time."""
    taken: list[Any] = []
    i = 0
    while limit and i + 1 < len(items) and type(items[i]) is float and (
            type(items[i + 1]) is list or items[i + 1].count(None) == PLAIN_NONES):
        taken += items[i:i + 2]
        i += 2
        limit -= 1
    return taken


@settings(max_examples=300, derandomize=True, deadline=None)
@given(outputs=st.lists(_ITEM, max_size=12), error=st.booleans(), limit=st.integers(1, 14))
def test_take_plain_takes_the_plain_pairs_at_the_head_up_to_the_limit(
        outputs: list[Any], error: bool, limit: int) -> None:
    box = OutputMailbox()
    stream = new_output_stream(
        EngineCoreRequest(request_id="r", prompt_token_ids=(1,),
                          sampling_params=SamplingParams(max_tokens=100), arrival_time=1.0),
        100, 0, box, lambda _stream, _running: None, ReaderPace())
    items: list[Any] = []
    for n, output in enumerate(outputs):
        items += [float(n + 1), output]
    if error:
        items.append(RuntimeError("the end"))
    box.items.extend(items)
    expected = _reference(items, limit)
    taken = stream.take_plain(limit)
    assert taken == expected
    assert list(box.items) == items[len(expected):]
    if taken:
        assert stream.timestamp == taken[-2]
