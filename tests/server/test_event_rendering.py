"""Streamed events of new text are spliced into a pre-rendered chunk: the bytes must be the
same as rendering the chunk, for any text and any model name."""

from __future__ import annotations

import json

from hypothesis import example, given, settings
from hypothesis import strategies as st

from anyio_genout.generate import FinishReason
from anyio_genout.server.chat_format import ChatFormat
from anyio_genout.server.formats import CompletionFormat, Format, sse_event
from anyio_genout.text.output import TextOutput

# Text the text layer can produce: any characters but lone surrogates.
_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1)


def _formats(model: str) -> list[Format]:
    return [CompletionFormat("cmpl-1", model, None), ChatFormat("chatcmpl-1", model, None),
            CompletionFormat("cmpl-2", model, None, echo=True, decode=lambda ids: "p")]


@settings(derandomize=True, max_examples=200, deadline=None)
@given(texts=st.lists(_TEXT, min_size=1, max_size=4), model=_TEXT,
       index=st.integers(0, 3))
@example(texts=['"\\\n\u2028\x00é🙂</script>'], model='m"\\', index=0)
def test_an_event_of_new_text_is_the_rendered_chunk(texts: list[str], model: str,
                                                    index: int) -> None:
    for fmt, reference in zip(_formats(model), _formats(model), strict=True):
        for text in texts:
            out = TextOutput("r", text, [1], prompt="p", prompt_token_ids=(1,))
            event = fmt.event(out, index)
            chunk = reference.chunk(out, index)
            assert chunk is not None
            assert event == sse_event(chunk)
            assert json.loads(event.removeprefix(b"data: "))  # well-formed


def test_finishes_logprobs_and_empty_steps_take_the_general_path() -> None:
    fmt, reference = CompletionFormat("c", "m", None), CompletionFormat("c", "m", None)
    last = TextOutput("r", "end", [2], finish_reason=FinishReason.LENGTH)
    chunk = reference.chunk(last, 0)
    assert chunk is not None and fmt.event(last, 0) == sse_event(chunk)
    assert fmt.event(TextOutput("r", "", [3]), 0) is None  # an incomplete character
