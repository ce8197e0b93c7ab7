"""How a stream takes what the reader buffered: a plain output is kept in the mailbox as its
token count, its tokens on the mailbox's one list (engine/mailbox.py), so no object per
step outlives the message. ``take_plain`` (the generate layer's coalescing) must take the
run of plain steps at the head, at most ``limit``, whichever way they were buffered, and
every other way of taking (``receive_output_nowait``, ``peek_output``) must give the
outputs the engine sent, in order, with their tokens."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from anyio_genout import EngineCoreRequest, SamplingParams
from anyio_genout.engine.mailbox import OutputMailbox
from anyio_genout.engine.pace import ReaderPace
from anyio_genout.engine.stream import EngineCoreOutputStream, new_output_stream
from anyio_genout.protocol import EngineCoreFinishReason, EngineCoreOutput
from anyio_genout.protocol.outputs import PLAIN_NONES

_TOKENS = st.lists(st.integers(0, 9), max_size=3)
# What the reader buffers: ("row", tokens) a plain row, or an output object (a plain one,
# as put_output or an earlier peek leaves it, or one that ends the stream).
_ITEM = st.one_of(
    st.builds(lambda t: ("row", t), _TOKENS),
    st.builds(lambda t: EngineCoreOutput("r", t), _TOKENS),
    st.builds(lambda t: EngineCoreOutput("r", t, num_nans_in_logits=2), _TOKENS),
    st.builds(lambda t: EngineCoreOutput("r", t, finish_reason=EngineCoreFinishReason.LENGTH),
              _TOKENS),
)


def _stream(items: list[Any], error: bool) -> tuple[EngineCoreOutputStream, OutputMailbox]:
    """A stream whose mailbox holds ``items`` as the reader would have buffered them."""
    box = OutputMailbox()
    stream = new_output_stream(
        EngineCoreRequest(request_id="r", prompt_token_ids=(1,),
                          sampling_params=SamplingParams(max_tokens=100), arrival_time=1.0),
        100, 0, box, lambda _stream, _running: None, ReaderPace())
    for n, item in enumerate(items):
        box.items.append(float(n + 1))
        if isinstance(item, tuple) and item and item[0] == "row":
            box.items.append(len(item[1]))
            box.tokens.extend(item[1])
        else:
            box.items.append(item)
    if error:
        box.items.append(RuntimeError("the end"))
    return stream, box


def _as_sent(item: Any) -> EngineCoreOutput:
    return EngineCoreOutput("r", list(item[1])) if isinstance(item, tuple) and \
        item[0] == "row" else item


def _plain(output: EngineCoreOutput) -> bool:
    return output.count(None) == PLAIN_NONES


@settings(max_examples=300, derandomize=True, deadline=None)
@given(items=st.lists(_ITEM, max_size=12), error=st.booleans(), limit=st.integers(1, 14),
       peek=st.booleans())
def test_take_plain_takes_the_plain_steps_at_the_head_up_to_the_limit(
        items: list[Any], error: bool, limit: int, peek: bool) -> None:
    # Nothing follows a terminal output (the reader closes the mailbox with it).
    ends = [n for n, item in enumerate(items) if isinstance(item, EngineCoreOutput)
            and item.finish_reason is not None]
    if ends:
        items, error = items[:ends[0] + 1], False
    stream, box = _stream(items, error)
    sent = [_as_sent(item) for item in items]
    if peek and sent:  # a look ahead first makes the head an output object: same result
        assert stream.peek_output() == sent[0]
    run = [output for output in sent[:limit]]
    head = 0
    while head < len(run) and _plain(run[head]):
        head += 1
    taken = stream.take_plain(limit)
    if not head:
        assert taken is None
        rest = sent
    else:
        assert taken is not None
        steps, tokens = taken
        assert steps == [x for n, output in enumerate(sent[:head])
                         for x in (float(n + 1), len(output.new_token_ids))]
        assert tokens == [t for output in sent[:head] for t in output.new_token_ids]
        assert stream.timestamp == float(head)
        rest = sent[head:]
    # What is left comes out as the outputs the engine sent, in order, tokens and all.
    for output in rest:
        assert stream.receive_output_nowait() == output
    assert not box.tokens
