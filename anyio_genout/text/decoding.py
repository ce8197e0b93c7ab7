"""One request's whole text state: detokenizer + stop strings + ``min_tokens`` (sans-IO).

:class:`TextDecoder` takes each engine output's new token ids (and, on the terminal output,
its :class:`~anyio_genout.FinishReason`) and returns a :class:`TextStep`: the text to emit
now, how many of the ids to keep, the stop string that matched, and the request's finish
reason once it finished (the engine's, or ``stop`` with the stop string on a match), the
one place where :class:`~.stream.TextStream` and a caller driving the token layer itself
learn how the text ends. The rules are vLLM 0.32's (``vllm/v1/engine/detokenizer.py``), with
the detokenizer fixes of :mod:`.detokenizer`:

* ``stop_terminated`` (the engine stopped on EOS or a stop token id: :func:`stop_terminated`
  of the finish reason): the last token is not detokenized unless
  ``include_stop_str_in_output`` (it is still kept).
* Stop strings are checked only once more than ``min_tokens`` tokens were generated, and only
  in the text after the first ``min_tokens`` tokens (a match may start before it).
* On a match the text is cut (:mod:`.stop_strings`), the ids after the one that completed the
  match are dropped, and the decoder is finished (finish reason ``stop``, the stop string as
  its stop reason).
* Text held back for stop strings is sent when the output is finished. Tokens still pending
  in the detokenizer then (an unfinished character at the end) give no text, as in vLLM:
  no trailing U+FFFD.
* ``detokenize=False``: no text and no stop strings (stop strings are refused, as vLLM does).
"""

from __future__ import annotations

import re
from bisect import bisect_left
from collections.abc import Sequence
from typing import Final

import attrs
import tokenizers

from ..errors import InvalidRequestError
from ..generate import FinishReason, FinishReasonKind
from ..generate.output import StopReason
from .detokenizer import IncrementalDetokenizer
from .stop_strings import StopStrings
from .tokenizer import Tokenizer

__all__ = ["TextDecoder", "TextStep", "stop_terminated"]


@attrs.frozen
class TextStep:
    """What one update gives: ``text`` to emit now (after hold-back; the truncated rest on a
    match), ``keep`` (how many of the update's ids to keep), the ``stop_string`` that matched
    in this update, and ``finish_reason``: None while the request runs, else how it ended
    (the engine's reason, or ``stop`` with the stop string on a match).
    """

    text: str
    keep: int
    stop_string: str | None = None
    finish_reason: FinishReason | None = None

    @property
    def finished(self) -> bool:
        """The request ended with this step (``finish_reason`` is set)."""
        return self.finish_reason is not None

    @property
    def stop_reason(self) -> StopReason | None:
        """``finish_reason.stop_reason``: the matched stop string, the engine's stop token id
        or string, a stop token sequence; None while running or for any other finish."""
        finish = self.finish_reason
        return None if finish is None else finish.stop_reason


def stop_terminated(finish_reason: FinishReason | None) -> bool:
    """The engine stopped on EOS or a stop token id (finish ``stop`` with no stop reason or an
    int one), so the last token is not text unless ``include_stop_str_in_output``, as in vLLM.
    Raises nothing."""
    return (finish_reason is not None and finish_reason.kind is FinishReasonKind.STOP
            and (finish_reason.stop_reason is None or type(finish_reason.stop_reason) is int))


#: Steps of one token without a match, shared (they are immutable): building a frozen attrs
#: instance costs about a third of a DecodeStream step.
_ONE_TOKEN: dict[str, TextStep] = {}
_ONE_TOKEN_MAX: Final = 16384
#: The held-back buffer is trimmed once this many of its chars were sent.
_TRIM: Final = 64


_new = object.__new__
_set_text = vars(TextStep)["text"].__set__
_set_keep = vars(TextStep)["keep"].__set__
_set_stop_string = vars(TextStep)["stop_string"].__set__
_set_finish_reason = vars(TextStep)["finish_reason"].__set__


def _one_token(text: str) -> TextStep:
    """``TextStep(text, 1)``, shared, or built by setting its slots directly (the frozen
    ``__init__`` goes through ``object.__setattr__`` per field: twice as slow)."""
    step = _ONE_TOKEN.get(text)
    if step is None:
        step = _new(TextStep)
        _set_text(step, text)
        _set_keep(step, 1)
        _set_stop_string(step, None)
        _set_finish_reason(step, None)
        if len(_ONE_TOKEN) < _ONE_TOKEN_MAX:
            _ONE_TOKEN[text] = step
    return step


#: The step of a token that adds no text now (bytes pending, or text held back).
_NO_TEXT: Final = _one_token("")


def _no_text(token_id: int) -> str:
    return ""


class TextDecoder:
    """Detokenizer, stop strings and ``min_tokens`` of one request.

    ``tokenizer``: the project's :class:`~.tokenizer.Tokenizer` (or a raw
    ``tokenizers.Tokenizer``, such as its :attr:`~.tokenizer.Tokenizer.backend`).

    Raises TypeError naming ``tokenizer`` for anything else; InvalidRequestError("stop", ...)
    for an empty stop string, or for stop strings with ``detokenize=False``;
    InvalidRequestError("min_tokens", ...) for a negative ``min_tokens``.
    """

    __slots__ = ("_append", "_armed", "_detok", "_done", "_end_a", "_end_b", "_end_re",
                 "_fast", "_fast_stops", "_hold", "_include", "_min_tokens", "_num_tokens",
                 "_off", "_overlap", "_pieces", "_recent", "_starts", "_step", "_stops",
                 "_unsent")

    def __init__(self, tokenizer: Tokenizer | tokenizers.Tokenizer,
                 prompt_token_ids: Sequence[int], *,
                 stop: Sequence[str] = (), include_stop_str_in_output: bool = False,
                 min_tokens: int = 0, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True, detokenize: bool = True) -> None:
        if isinstance(tokenizer, Tokenizer):
            backend = tokenizer.backend
        elif isinstance(tokenizer, tokenizers.Tokenizer):
            backend = tokenizer
        else:
            raise TypeError(f"tokenizer must be an anyio_genout.text.Tokenizer (or a "
                            f"tokenizers.Tokenizer), got {type(tokenizer).__name__}")
        stops = StopStrings(stop, include_stop_str_in_output)
        if stops.stops and not detokenize:
            raise InvalidRequestError("stop", "stop strings need detokenize=True")
        if min_tokens < 0:
            raise InvalidRequestError("min_tokens", f"must be >= 0, got {min_tokens}")
        self._detok = IncrementalDetokenizer(
            backend, prompt_token_ids, skip_special_tokens=skip_special_tokens,
            spaces_between_special_tokens=spaces_between_special_tokens,
        ) if detokenize else None
        self._step = self._detok.step if self._detok is not None else _no_text
        self._stops = stops if stops.stops else None
        self._include = include_stop_str_in_output
        self._min_tokens = min_tokens
        self._num_tokens = 0           # output tokens so far, counted until armed
        self._armed = min_tokens == 0  # more than min_tokens tokens: stop strings are checked
        self._end_re = None
        if stops.stops:
            longest = stops.longest
            self._hold = 0 if include_stop_str_in_output else longest - 1  # (hold_back)
            self._overlap = longest - 1
            # Where each stop string's search starts once the held text is `_hold` chars long.
            self._starts = tuple((s, self._hold + 1 - len(s)) for s in stops.stops)
            # A match can end only in a piece holding some stop's last char: up to two such
            # chars are looked for with `in`, more with a character class.
            ends = sorted({s[-1] for s in stops.stops})
            self._end_a, self._end_b = (ends[0], ends[-1]) if len(ends) <= 2 else ("", "")
            if len(ends) > 2:
                self._end_re = re.compile("[" + re.escape("".join(ends)) + "]").search
        else:
            self._hold = self._overlap = 0
            self._starts = ()
            self._end_a = self._end_b = ""
        self._pieces: list[str] = []   # the whole text, in pieces (joined when read)
        self._append = self._pieces.append
        # Held back: the text's last `_hold` chars at most, `_unsent[_off:]` (the chars
        # before `_off` were sent: one slice a token fewer; trimmed every _TRIM chars).
        self._unsent = ""
        self._off = 0
        self._recent = ""              # the text's last `_overlap` chars (when included)
        self._done = False
        # One-token updates without a finish take a short path: no stops at all, or stops
        # that are held back (not included).
        self._fast = detokenize and self._stops is None
        self._fast_stops = self._hold > 0

    @property
    def text(self) -> str:
        """The whole output text so far (including what is held back)."""
        pieces = self._pieces
        if len(pieces) > 1:
            pieces[:] = ["".join(pieces)]
        return pieces[0] if pieces else ""

    @property
    def finished(self) -> bool:
        """True after a finished update or a stop-string match."""
        return self._done

    def update(self, token_ids: Sequence[int],
               finish_reason: FinishReason | None = None) -> TextStep:
        """Take one engine output's new ids; ``finish_reason``: the output's (None while the
        request runs; on the terminal output, held-back text is sent, pending bytes are dropped
        and :func:`stop_terminated` says whether its last token is text).

        The step's ``finish_reason`` is ``finish_reason``, or ``stop`` with the stop string
        when one matched (then the decoder is finished even if the engine is not).

        Raises RuntimeError once the decoder is finished (after a match or a finished update).
        """
        if finish_reason is not None or len(token_ids) != 1:
            return self._update(token_ids, finish_reason)
        return self.push(token_ids[0])

    def push(self, token_id: int) -> TextStep:
        """``update([token_id])``: one token of a running request (a stream's once-per-token
        path; a step without a match is shared between calls, which is safe: it is frozen).

        Raises RuntimeError once the decoder is finished (after a match or a finished update).
        """
        if self._fast:
            piece = self._step(token_id)
            if piece:
                self._append(piece)
            try:
                return _ONE_TOKEN[piece]
            except KeyError:
                return _one_token(piece)
        if not self._fast_stops:
            return self._update([token_id], None)
        piece = self._step(token_id)
        armed = self._armed
        if not armed:
            self._num_tokens += 1
            armed = self._armed = self._num_tokens > self._min_tokens
        if not piece:
            return _NO_TEXT
        self._append(piece)
        buf = self._unsent + piece
        off = self._off
        # A match ends in the new text: only a piece holding some stop's last char can end one
        # (with more than two such chars both are "", and a character class decides).
        if armed and (self._end_a in piece or self._end_b in piece):
            match = self._match_in(buf, off, piece)
            if match is not None:
                return match
        cut = len(buf) - self._hold
        if cut > off:
            if cut < _TRIM:
                self._unsent = buf
                self._off = cut
            else:
                self._unsent = buf[cut:]
                self._off = 0
            text = buf[off:cut]
            try:
                return _ONE_TOKEN[text]
            except KeyError:
                return _one_token(text)
        self._unsent = buf
        return _NO_TEXT

    def _match_in(self, buf: str, off: int, piece: str) -> TextStep | None:
        """:meth:`push`'s check of a piece that may end a match (``buf[off:]`` is the held
        text and then ``piece``): the step of the match, or None."""
        if self._end_re is not None and self._end_re(piece) is None:
            return None
        held = len(buf) - len(piece) - off
        if held == self._hold:
            for stop, start in self._starts:
                if buf.find(stop, off + start) >= 0:
                    return self._matched(buf[off:], held, [0, len(piece)], 1)
        elif self._stops.search(buf[off:], held) is not None:  # type: ignore[union-attr]
            return self._matched(buf[off:], held, [0, len(piece)], 1)
        return None

    def _update(self, token_ids: Sequence[int], finish: FinishReason | None) -> TextStep:
        """The general path: several (or no) ids, a finish, stops that are included."""
        if self._done:
            raise RuntimeError("the text decoder is finished: it takes no more outputs")
        finished = finish is not None
        count = len(token_ids)
        num_prev = self._num_tokens  # counted until armed (then min_tokens is behind us)
        if not self._armed:
            self._num_tokens = num_prev + count
            self._armed = self._num_tokens > self._min_tokens
        if finished:
            self._done = True
            self._fast = self._fast_stops = False
        detok = self._detok
        if detok is None:
            return TextStep("", count, None, finish)
        stops = self._stops
        skip_last = (finished and count > 0 and not self._include
                     and stop_terminated(finish))
        offsets = [0]  # text length after each new token, from this update's start
        pieces: list[str] = []
        length = 0
        for token_id in (token_ids[:-1] if skip_last else token_ids):
            piece = detok.step(token_id)
            if piece:
                pieces.append(piece)
                length += len(piece)
            offsets.append(length)
        if skip_last:
            offsets.append(length)
        if finished:
            detok.finish()  # pending tokens (an unfinished character) give no text, as in vLLM
        new = "".join(pieces)
        if new:
            self._pieces.append(new)
        if stops is None:
            return _one_token(new) if count == 1 and not finished else \
                TextStep(new, count, None, finish)
        include = stops.include_in_output
        recent = self._recent if include else self._unsent[self._off:]
        window = recent + new
        if new and self._armed:
            first = offsets[max(self._min_tokens - num_prev, 0)]
            if stops.search(window, len(recent) + first) is not None:
                return self._matched(window, len(recent), offsets, count, first)
        if include:
            self._recent = window[-self._overlap:] if self._overlap else ""
            return _one_token(new) if count == 1 and not finished else \
                TextStep(new, count, None, finish)
        hold = self._hold
        self._off = 0
        if finished or len(window) <= hold or not hold:
            self._unsent = "" if finished or not hold else window
            out = window if finished or not hold else ""
        else:
            self._unsent = window[-hold:]
            out = window[:-hold]
        return _one_token(out) if count == 1 and not finished else \
            TextStep(out, count, None, finish)

    def _matched(self, window: str, shift: int, offsets: list[int], count: int,
                 first: int = 0) -> TextStep:
        """The step of a match in ``window`` (the ``shift`` chars of unsent or recent text +
        this update's text, with ``offsets`` per token from where this update's text starts)."""
        stops = self._stops
        assert stops is not None
        include = stops.include_in_output
        match = stops.search(window, shift + first)
        assert match is not None
        self._done = True
        self._fast = self._fast_stops = False
        keep = min(bisect_left(offsets, match.end - shift, lo=1), count)
        cut = stops.cut(match)
        dropped = len(window) - cut
        if dropped:
            text = self.text
            self._pieces[:] = [text[:len(text) - dropped]]
        self._unsent = self._recent = ""
        self._off = 0
        return TextStep(window[shift if include else 0:cut], keep, match.stop,
                        FinishReason.stop(match.stop))
