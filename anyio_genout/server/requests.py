"""The one translation of an OpenAI request body into :class:`TextRequest`.

``anyio-genout serve`` (:mod:`.app`) and ``anyio-genout run`` on OpenAI batch files
(:mod:`anyio_genout.cli.run_batch`) both build their requests here, so a body means the same
to both. Every error is an :class:`ApiError` (400) naming the field.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import attrs

from ..errors import GenoutError
from ..protocol import SamplingParams, StructuredOutputsParams
from ..text.request import TextRequest
from .errors import ApiError, error_for
from .models import ChatCompletionRequest, CompletionRequest

__all__ = ["chat_request", "check_unicode", "choices", "completion_request"]

#: The sampling fields passed on as they are when the request sets them.
_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
             "frequency_penalty", "repetition_penalty")


def check_unicode(value: object, field: str) -> None:
    """Raise ApiError (400) naming the place of a lone surrogate (valid JSON escapes, not
    text a tokenizer or template takes) in ``value``'s strings."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ApiError(400, f"invalid request: {field}: is not valid Unicode text: lone "
                           f"surrogate at index {exc.start}", field) from None
    elif isinstance(value, list):
        for i, item in enumerate(value):
            check_unicode(item, f"{field}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            check_unicode(key, field)
            check_unicode(item, f"{field}.{key}")


def _structured(body: CompletionRequest | ChatCompletionRequest
                ) -> StructuredOutputsParams | None:
    """``response_format`` or vLLM's ``structured_outputs`` as the engine's constraint (its
    checks run on entering the request and name ``structured_outputs.<kind>``)."""
    form, extension = body.response_format, body.structured_outputs
    if form is not None and form.type != "text" and extension is not None:
        raise ApiError(400, "invalid request: structured_outputs: give either "
                       "response_format or structured_outputs, not both", "structured_outputs")
    if extension is not None:
        try:
            return StructuredOutputsParams(**extension)
        except TypeError as exc:
            raise ApiError(400, f"invalid request: structured_outputs: {exc}",
                           "structured_outputs") from None
        except GenoutError as exc:
            raise error_for(exc) from None
    if form is None or form.type == "text":
        return None
    if form.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if form.json_schema is None or form.json_schema.json_schema is None:
        raise ApiError(400, "invalid request: response_format.json_schema: needs a schema "
                       "with type json_schema", "response_format.json_schema")
    return StructuredOutputsParams(json=form.json_schema.json_schema)


def _sampling(body: CompletionRequest | ChatCompletionRequest, max_tokens: int | None,
              logprobs: int | None) -> SamplingParams:
    given = {name: getattr(body, name) for name in _SAMPLING if getattr(body, name) is not None}
    try:
        return SamplingParams(max_tokens=max_tokens, min_tokens=body.min_tokens,
                              ignore_eos=body.ignore_eos, logprobs=logprobs,
                              stop_token_ids=tuple(body.stop_token_ids or ()),
                              structured_outputs=_structured(body), **given)
    except (TypeError, ValueError) as exc:
        raise ApiError(400, f"invalid sampling parameters: {exc}") from None


def choices(request: TextRequest, n: int) -> list[TextRequest]:
    """The ``n`` child requests of one with ``n`` choices, as vLLM makes them: ids
    ``"{i}_{id}"`` and seeds ``seed + i`` when a seed is given."""
    if n == 1:
        return [request]
    params = request.sampling_params
    return [attrs.evolve(request, request_id=f"{i}_{request.request_id}",
                         sampling_params=params if params.seed is None else
                         attrs.evolve(params, seed=params.seed + i)) for i in range(n)]


def _request_id(prefix: str, body: CompletionRequest | ChatCompletionRequest) -> str:
    return body.request_id or f"{prefix}-{os.urandom(16).hex()}"


def _stop(body: CompletionRequest | ChatCompletionRequest) -> tuple[str, ...]:
    stop = body.stop
    return () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)


def _one_prompt(prompt: str | list[int] | list[str] | list[list[int]]
                ) -> tuple[str | None, list[int] | None]:
    if isinstance(prompt, str):
        return prompt, None
    if not prompt:
        raise ApiError(400, "invalid request: prompt: must not be empty", "prompt")
    if all(isinstance(t, int) for t in prompt):
        return None, [t for t in prompt if isinstance(t, int)]
    if len(prompt) != 1:
        raise ApiError(400, "invalid request: prompt: one prompt per request (a list of "
                       "several prompts is not supported yet)", "prompt")
    first = prompt[0]
    return (first, None) if isinstance(first, str) else (None, list(first))  # type: ignore[arg-type]


def completion_request(body: CompletionRequest, *,
                       decode: Callable[[list[int]], str] | None
                       ) -> tuple[TextRequest, str | None]:
    """The request of a ``/v1/completions`` body, and the ``echo`` text (None without echo).

    ``decode`` turns prompt token ids into the echoed text (raising ApiError for ids out of
    the vocabulary); without it ``echo`` is refused. Raises ApiError (400) naming the field.
    """
    check_unicode(body.prompt, "prompt")
    if body.echo and decode is None:
        raise ApiError(400, "invalid request: echo: not supported here yet", "echo")
    if body.echo and body.logprobs is not None:
        raise ApiError(400, "invalid request: echo: not supported with logprobs yet (it "
                       "needs the prompt's logprobs)", "echo")
    prompt, ids = _one_prompt(body.prompt)
    echo = None
    if body.echo:
        assert decode is not None
        if prompt is not None:
            echo = prompt
        else:
            assert ids is not None
            echo = decode(ids)
    request = TextRequest(
        request_id=_request_id("cmpl", body), prompt=prompt, prompt_token_ids=ids,
        sampling_params=_sampling(body, body.max_tokens, body.logprobs),
        stop=_stop(body), include_stop_str_in_output=body.include_stop_str_in_output,
        skip_special_tokens=body.skip_special_tokens,
        spaces_between_special_tokens=body.spaces_between_special_tokens,
        add_special_tokens=body.add_special_tokens if prompt is not None else None)
    return request, echo


def chat_request(body: ChatCompletionRequest) -> TextRequest:
    """The request of a ``/v1/chat/completions`` body (its ``sampling_params.logprobs`` is
    how many alternatives to show, None without ``logprobs``). Raises ApiError (400) naming
    the field."""
    check_unicode(body.messages, "messages")
    check_unicode(body.chat_template_kwargs, "chat_template_kwargs")
    top = (body.top_logprobs or 0) if body.logprobs else None
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "invalid request: top_logprobs: needs logprobs=true",
                       "top_logprobs")
    return TextRequest(
        request_id=_request_id("chatcmpl", body), messages=body.messages,
        sampling_params=_sampling(body, body.max_completion_tokens or body.max_tokens, top),
        stop=_stop(body), include_stop_str_in_output=body.include_stop_str_in_output,
        skip_special_tokens=body.skip_special_tokens,
        spaces_between_special_tokens=body.spaces_between_special_tokens,
        add_generation_prompt=body.add_generation_prompt,
        chat_template_kwargs=body.chat_template_kwargs)
