"""vLLM's and OpenAI's response shapes: completions and chat completions, whole or streamed."""

from __future__ import annotations

import time
from typing import Any

from ..generate import FinishReason
from ..text.output import CollectedTextOutput, TextOutput, TokenLogprob

__all__ = ["ChatFormat", "CompletionFormat", "Format", "usage"]


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens, "prompt_tokens_details": None}


def _finish(reason: FinishReason | None) -> tuple[str | None, int | str | None]:
    if reason is None:
        return None, None
    stop = reason.stop_reason
    return reason.kind.value, stop if isinstance(stop, int | str) else None


class Format:
    """What one route's responses look like; ``top`` is how many alternatives to show."""

    object_whole = ""
    object_chunk = ""

    def __init__(self, response_id: str, model: str, top: int | None) -> None:
        self.id = response_id
        self.model = model
        self.top = top
        self.created = int(time.time())

    def envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def first_chunks(self, n: int) -> list[dict[str, Any]]:
        return []

    def chunk(self, out: TextOutput, index: int) -> dict[str, Any] | None:
        raise NotImplementedError

    def whole(self, outs: list[CollectedTextOutput]) -> dict[str, Any]:
        """The whole response of ``outs``, one choice each (by index); the usage counts the
        prompt once and the completions of all."""
        body = self.envelope(self.object_whole, [self.whole_choice(out, i)
                                                 for i, out in enumerate(outs)])
        body["usage"] = usage(outs[0].usage.prompt_token_count,
                              sum(out.usage.output_token_count for out in outs))
        return body

    def whole_choice(self, out: CollectedTextOutput, index: int) -> dict[str, Any]:
        raise NotImplementedError

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        body = self.envelope(self.object_chunk, [])
        body["usage"] = usage(prompt_tokens, completion_tokens)
        return body


class CompletionFormat(Format):
    object_whole = object_chunk = "text_completion"

    def __init__(self, response_id: str, model: str, top: int | None,
                 echo: str | None = None) -> None:
        super().__init__(response_id, model, top)
        self._offsets: dict[int, int] = {}  # by choice index
        self._echo = echo  # the prompt text, prepended to each choice's text

    def first_chunks(self, n: int) -> list[dict[str, Any]]:
        if not self._echo:
            return []
        return [self.envelope(self.object_chunk, [
            {"index": i, "text": self._echo, "logprobs": None, "finish_reason": None,
             "stop_reason": None}]) for i in range(n)]

    def _logprobs(self, rows: list[list[TokenLogprob]] | None, index: int
                  ) -> dict[str, Any] | None:
        if self.top is None or rows is None:
            return None
        offsets, tokens, values, tops = [], [], [], []
        offset = self._offsets.get(index, 0)
        for row in rows:
            sampled = row[0]
            offsets.append(offset)
            offset += len(sampled.token)
            tokens.append(sampled.token)
            values.append(sampled.logprob)
            tops.append({e.token: e.logprob for e in row[: self.top + 1]} if self.top else None)
        self._offsets[index] = offset
        return {"text_offset": offsets, "token_logprobs": values, "tokens": tokens,
                "top_logprobs": tops}

    def _choice(self, text: str, rows: list[list[TokenLogprob]] | None,
                reason: FinishReason | None, index: int) -> dict[str, Any]:
        finish, stop = _finish(reason)
        return {"index": index, "text": text, "logprobs": self._logprobs(rows, index),
                "finish_reason": finish, "stop_reason": stop}

    def chunk(self, out: TextOutput, index: int) -> dict[str, Any] | None:
        if not out.text and not out.finished and not (out.logprobs and self.top is not None):
            return None
        return self.envelope(self.object_chunk,
                             [self._choice(out.text, out.logprobs, out.finish_reason, index)])

    def whole_choice(self, out: CollectedTextOutput, index: int) -> dict[str, Any]:
        choice = self._choice((self._echo or "") + out.text, out.logprobs, out.finish_reason,
                              index)
        choice["prompt_logprobs"] = None
        return choice


def _entry(entry: TokenLogprob) -> dict[str, Any]:
    return {"token": entry.token, "logprob": entry.logprob,
            "bytes": list(entry.token.encode("utf-8"))}


class ChatFormat(Format):
    object_whole = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def _logprobs(self, rows: list[list[TokenLogprob]] | None) -> dict[str, Any] | None:
        if self.top is None or rows is None:
            return None
        return {"content": [{**_entry(row[0]),
                             "top_logprobs": [_entry(e) for e in row[1: self.top + 1]]}
                            for row in rows]}

    def first_chunks(self, n: int) -> list[dict[str, Any]]:
        return [self.envelope(self.object_chunk, [
            {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
             "finish_reason": None}]) for i in range(n)]

    def chunk(self, out: TextOutput, index: int) -> dict[str, Any] | None:
        if not out.text and not out.finished and not (out.logprobs and self.top is not None):
            return None
        finish, stop = _finish(out.finish_reason)
        choice = {"index": index, "delta": {"content": out.text} if out.text else {},
                  "logprobs": self._logprobs(out.logprobs), "finish_reason": finish}
        if finish is not None:
            choice["stop_reason"] = stop
        return self.envelope(self.object_chunk, [choice])

    def whole_choice(self, out: CollectedTextOutput, index: int) -> dict[str, Any]:
        finish, stop = _finish(out.finish_reason)
        return {"index": index, "message": {"role": "assistant", "content": out.text},
                "logprobs": self._logprobs(out.logprobs), "finish_reason": finish,
                "stop_reason": stop}
