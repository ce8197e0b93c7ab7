"""The one translation of an OpenAI request body into :class:`TextRequest`.

``anyio-genout serve`` (:mod:`.app`) and ``anyio-genout run`` on OpenAI batch files
(:mod:`anyio_genout.cli.run_batch`) both build their requests here, so a body means the same
to both. Every error is an :class:`ApiError` (400) naming the field.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from ..errors import GenoutError, InvalidRequestError
from ..protocol import SamplingParams, StructuredOutputsParams, validation
from ..text.chat_template import ROLES
from ..text.request import TextRequest
from .chat_format import ChatFormat
from .errors import ApiError, error_for
from .fields import check_fields, check_logprob_counts, echo_without_generation
from .formats import CompletionFormat, Format
from .models import ChatCompletionRequest, CompletionRequest
from .tools import ChatParsing, ToolPlan, ToolServing, plan_tools

__all__ = ["Choices", "chat_choices", "chat_kwargs", "chat_request", "chat_role",
           "check_max_tokens", "check_n", "check_unicode", "choices", "completion_choices",
           "template_kwargs"]


def check_unicode(value: object, field: str) -> None:
    """Raise ApiError (400) naming the place of a lone surrogate (valid JSON escapes, not
    text a tokenizer or template takes) in ``value``'s strings
    (:func:`~anyio_genout.protocol.validation.check_unicode`, the one check)."""
    try:
        validation.check_unicode(value, field)
    except InvalidRequestError as exc:
        raise error_for(exc) from None

#: Below this temperature sampling is greedy (vLLM's _SAMPLING_EPS).
_GREEDY = 1e-5

#: The sampling fields passed on as they are when the request sets them.
_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
             "frequency_penalty", "repetition_penalty")


def template_kwargs(chat_template: str | None, kwargs: dict[str, Any] | None, *,
                    trusted: bool) -> dict[str, Any] | None:
    """The chat template variables of a body: ``chat_template_kwargs`` with a top-level
    ``chat_template`` put in (it wins, as in vLLM). A request's own template is a program
    the server would run (CVE-2025-61620): refused unless ``trusted``
    (``--trust-request-chat-template``). Raises ApiError (400) naming ``chat_template`` or
    ``chat_template_kwargs.chat_template``."""
    check_unicode(chat_template, "chat_template")
    check_unicode(kwargs, "chat_template_kwargs")
    given = [name for name, value in (("chat_template", chat_template), (
        "chat_template_kwargs.chat_template", (kwargs or {}).get("chat_template")))
        if value is not None]
    if given and not trusted:
        raise ApiError(400, f"invalid request: {given[0]}: Chat template is passed with "
                       "request, but --trust-request-chat-template is not set. Refused "
                       "request with untrusted chat template.", given[0])
    if chat_template is None:
        return kwargs
    return {**(kwargs or {}), "chat_template": chat_template}


def _structured(body: CompletionRequest | ChatCompletionRequest
                ) -> StructuredOutputsParams | None:
    """``response_format`` or vLLM's ``structured_outputs`` as the engine's constraint (its
    checks run on entering the request and name ``structured_outputs.<kind>``)."""
    form, extension = body.response_format, body.structured_outputs
    if form is not None and form.type != "text" and extension is not None:
        raise ApiError(400, "invalid request: structured_outputs: give either "
                       "response_format or structured_outputs, not both", "structured_outputs")
    if extension is not None:
        known = {field.name for field in attrs.fields(StructuredOutputsParams)}
        unknown = sorted(str(key) for key in extension if key not in known)
        if unknown:
            raise ApiError(400, f"invalid request: structured_outputs.{unknown[0]}: not a "
                           f"field of structured_outputs (its fields: {', '.join(sorted(known))})",
                           f"structured_outputs.{unknown[0]}")
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


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """vLLM's ``logit_bias``: token ids as strings, biases clamped to [-100, 100]."""
    if bias is None:
        return None
    found: dict[int, float] = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise ApiError(400, f"invalid request: logit_bias: Invalid key in logit_bias: "
                           f"{key!r} is not a token id", "logit_bias") from None
        found[token] = min(100.0, max(-100.0, value))
    return found


def _check_body(body: CompletionRequest | ChatCompletionRequest, *, chat: bool) -> None:
    """The checks vLLM's request models make across fields (and :func:`check_fields`).

    ``param`` is vLLM's: the field its validator names (``stream_options``,
    ``prompt_logprobs``), or None where vLLM's check names none (``n`` with greedy
    sampling: its SamplingParams raises without a parameter); the message names the field."""
    check_fields(body.model_extra, chat=chat)
    options = body.stream_options
    if options is not None and not body.stream and (options.model_fields_set
                                                    or options.model_extra):
        # vLLM's validate_stream_options: a non-empty object (``{}`` passes, as there).
        raise ApiError(400, "invalid request: stream_options: Stream options can only be "
                       "defined when `stream=True`.", "stream_options")
    if body.prompt_logprobs is not None and body.stream and body.prompt_logprobs != 0:
        raise ApiError(400, "invalid request: prompt_logprobs: `prompt_logprobs` are not "
                       "available when `stream=True`.", "prompt_logprobs")
    check_logprob_counts(body)
    if body.n > 1 and body.temperature is not None and body.temperature < _GREEDY:
        raise ApiError(400, f"n must be 1 when using greedy sampling, got {body.n}.")


def _sampling(body: CompletionRequest | ChatCompletionRequest, max_tokens: int | None,
              logprobs: int | None) -> SamplingParams:
    given = {name: getattr(body, name) for name in _SAMPLING if getattr(body, name) is not None}
    try:
        return SamplingParams(max_tokens=max_tokens, min_tokens=body.min_tokens,
                              ignore_eos=body.ignore_eos, logprobs=logprobs,
                              stop_token_ids=tuple(body.stop_token_ids or ()),
                              logit_bias=_logit_bias(body.logit_bias),
                              allowed_token_ids=body.allowed_token_ids,
                              prompt_logprobs=body.prompt_logprobs,
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
    """vLLM's response and engine request id: ``{prefix}-{request_id}`` (the route puts
    an ``X-Request-Id`` header's value there first), random when neither is given."""
    return f"{prefix}-{body.request_id or os.urandom(16).hex()}"


def _stop(body: CompletionRequest | ChatCompletionRequest) -> tuple[str, ...]:
    stop = body.stop
    return () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)


#: One prompt of a completions body: its text, or its token ids.
Prompt = tuple[str | None, list[int] | None]


def _prompts(prompt: str | list[int] | list[str] | list[list[int]]) -> list[Prompt]:
    """The prompts of ``prompt``: a string, token ids, or a list of either (several)."""
    if isinstance(prompt, str):
        if not prompt:  # vLLM's words
            raise ApiError(400, "invalid request: prompt: Either prompt or prompt_embeds must "
                           "be provided and non-empty.", "prompt")
        return [(prompt, None)]
    if not prompt:
        raise ApiError(400, "invalid request: prompt: must not be empty", "prompt")
    if type(prompt[0]) is int:  # the model's union: all token ids, or none
        return [(None, list(prompt))]
    found: list[Prompt] = []
    for i, one in enumerate(prompt):
        if isinstance(one, str):
            found.append((one, None))
        elif isinstance(one, list) and one:
            found.append((None, list(one)))
        else:
            raise ApiError(400, f"invalid request: prompt[{i}]: must not be empty",
                           f"prompt[{i}]")
    return found


def check_n(n: int, max_n: int) -> None:
    """Raise ApiError (400 naming ``n``) for an ``n`` above the server's ``max_n``."""
    if n > max_n:
        raise ApiError(400, f"invalid request: n: must be at most {max_n}, got {n}", "n")


def check_max_tokens(max_tokens: int | None, field: str, max_model_len: int | None) -> None:
    """Raise ApiError (400 naming ``field``) for a ``max_tokens`` above ``max_model_len``
    (None: not checked): :func:`.validation.check_max_tokens`'s refusal in vLLM's words."""
    try:
        if max_model_len is not None:
            validation.check_max_tokens(max_tokens, max_model_len, field)
    except InvalidRequestError as exc:
        raise ApiError(400, exc.message, exc.field) from None


def _check_vocab(ids: list[int], field: str, vocab_size: int) -> None:
    try:
        validation.check_token_ids(ids, field, vocab_size)  # what the engine client checks
    except InvalidRequestError as exc:
        raise error_for(exc) from None


@attrs.frozen
class Choices:
    """A completions or chat completions body as child requests: one per prompt and
    choice, in choice ``index`` order (prompt index * ``n`` + i, as vLLM numbers them), and
    what its response looks like (:meth:`format`). The server and batch files both run
    these (:class:`~anyio_genout.server.response.TextResponse`)."""

    response_id: str
    requests: list[TextRequest]
    n: int
    logprobs: int | None  #: how many alternatives the logprobs show (None: no logprobs)
    echo: bool = False
    prompt_only: bool = False  #: completions' echo with max_tokens 0 (the prompt alone)
    chat: bool = False
    #: The field of the body's structured-output constraint (None: it has none).
    constraint: str | None = None
    #: Whether the whole response shows the prompt's logprobs (``prompt_logprobs``).
    prompt_logprobs: bool = False
    #: Logprob tokens shown as ``token_id:<id>`` (``return_tokens_as_token_ids``).
    token_ids: bool = False
    #: Chat ``echo``: the text the answer begins with (None: no echo).
    echo_text: str | None = None
    #: Chat: how the output is read for reasoning and tool calls (None: plain text).
    parsing: ChatParsing | None = None
    #: Chat: the answer's role (vLLM's ``get_chat_request_role``, :func:`chat_role`).
    role: str = "assistant"

    def format(self, model: str, decode: Callable[[Sequence[int]], str],
               token_id: Callable[[str], int | None] | None = None) -> Format:
        """The response format (``decode`` gives the echoed text of token-id prompts;
        ``token_id`` a token's id in the vocabulary, for the reasoning tokens a chat's usage
        counts)."""
        if self.chat:
            return ChatFormat(self.response_id, model, self.logprobs,
                              constraint=self.constraint, prompt_logprobs=self.prompt_logprobs,
                              token_ids=self.token_ids, echo_text=self.echo_text,
                              parsing=self.parsing, role=self.role, token_id=token_id)
        return CompletionFormat(self.response_id, model, self.logprobs, echo=self.echo,
                                prompt_only=self.prompt_only, n=self.n, decode=decode,
                                constraint=self.constraint, token_ids=self.token_ids,
                                prompt_logprobs=self.prompt_logprobs)


def _constraint(body: CompletionRequest | ChatCompletionRequest) -> str | None:
    """Which field of ``body`` holds its structured-output constraint, if any."""
    if body.structured_outputs is not None:
        return "structured_outputs"
    form = body.response_format
    return "response_format" if form is not None and form.type != "text" else None


def completion_choices(body: CompletionRequest, *, max_n: int, max_model_len: int | None,
                       vocab_size: int | None = None) -> Choices:
    """The child requests of a ``/v1/completions`` body (see :class:`Choices`).

    ``prompt`` is a string, token ids, or a list of several of either; each prompt is one
    request (id ``"{id}-{p}"`` when there are several, as vLLM's), each of its ``n`` choices
    a child of it (:func:`choices`). At most ``max_n`` choices in all; ``max_tokens`` at
    most ``max_model_len`` (None: not checked here); token ids below ``vocab_size`` (None:
    the engine client checks them). With ``echo`` and ``logprobs`` the requests ask the
    engine for the prompt's logprobs (``prompt_logprobs``), as vLLM's do.

    Raises ApiError (400) naming the field: ``n``, ``prompt`` (empty, or more than
    ``max_n`` choices: counted first), ``prompt[i]``, ``max_tokens``, ...
    """
    check_n(body.n, max_n)
    given = body.prompt  # several prompts: a list whose items are not token ids
    count = len(given) if given and type(given) is list and type(given[0]) is not int else 1
    if count * body.n > max_n:
        raise ApiError(400, f"invalid request: prompt: {count} prompts with n={body.n} "
                       f"are {count * body.n} choices; at most {max_n} (the server's "
                       "max_n) per request", "prompt")
    check_unicode(given, "prompt")
    _check_body(body, chat=False)
    check_max_tokens(body.max_tokens, "max_tokens", max_model_len)
    prompts = _prompts(given)
    prompt_only = echo_without_generation(body.echo, body.max_tokens)
    request_id = _request_id("cmpl", body)
    params = _sampling(body, 1 if prompt_only else body.max_tokens, body.logprobs)
    if body.echo and body.logprobs is not None:
        params = attrs.evolve(params, prompt_logprobs=max(body.logprobs,
                                                          body.prompt_logprobs or 0))
    several = len(prompts) > 1
    requests: list[TextRequest] = []
    for p, (prompt, ids) in enumerate(prompts):
        if ids is not None and vocab_size is not None:
            _check_vocab(ids, f"prompt[{p}]" if several else "prompt", vocab_size)
        request = TextRequest(
            request_id=f"{request_id}-{p}" if several else request_id, prompt=prompt,
            prompt_token_ids=ids, sampling_params=params, stop=_stop(body),
            include_stop_str_in_output=body.include_stop_str_in_output,
            skip_special_tokens=body.skip_special_tokens,
            spaces_between_special_tokens=body.spaces_between_special_tokens,
            add_special_tokens=body.add_special_tokens if prompt is not None else None,
            bad_words=tuple(body.bad_words), truncate_prompt_tokens=body.truncate_prompt_tokens,
            truncation_side=body.truncation_side)
        requests.extend(choices(request, body.n))
    return Choices(request_id, requests, body.n, body.logprobs, echo=body.echo,
                   prompt_only=prompt_only, constraint=_constraint(body),
                   prompt_logprobs=body.prompt_logprobs is not None,
                   token_ids=bool(body.return_tokens_as_token_ids))


def chat_choices(body: ChatCompletionRequest, *, max_n: int, max_model_len: int | None,
                 trust_request_chat_template: bool = False,
                 tool_serving: ToolServing | None = None) -> Choices:
    """The child requests of a ``/v1/chat/completions`` body (see :class:`Choices`): ``n``
    at most ``max_n``, ``max_completion_tokens`` and ``max_tokens`` at most
    ``max_model_len`` (None: not checked here), a request's own chat template only if
    ``trust_request_chat_template``; ``tools`` and ``tool_choice`` served with
    ``tool_serving``'s parsers (None: none, ``tool_choice="auto"`` refused). Raises
    ApiError (400) naming the field.

    As vLLM's: ``echo`` without ``prompt_logprobs`` asks for ``top_logprobs`` (0 unset)
    prompt logprobs, which the whole response shows (top-level ``prompt_logprobs``); the
    answer's role is :func:`chat_role`.
    """
    _check_body(body, chat=True)
    check_n(body.n, max_n)
    check_max_tokens(body.max_completion_tokens, "max_completion_tokens", max_model_len)
    check_max_tokens(body.max_tokens, "max_tokens", max_model_len)
    request, plan = _chat_request(body, trust_request_chat_template,
                                  tool_serving or ToolServing())
    constraint = _constraint(body)
    if plan.schema is not None:
        constraint = "tool_choice"
    return Choices(request.request_id, choices(request, body.n), body.n,
                   request.sampling_params.logprobs, chat=True, constraint=constraint,
                   prompt_logprobs=request.sampling_params.prompt_logprobs is not None,
                   token_ids=bool(body.return_tokens_as_token_ids),
                   echo_text=_echo_text(body) if body.echo else None, parsing=plan.parsing,
                   role=chat_role(body))


def _check_messages(messages: list[dict[str, Any]]) -> None:
    """What vLLM refuses only when its chat template is applied (so with ``param`` None,
    the field named in the message): no messages (transformers' refusal, in its words),
    and a role the template does not know; ours are the roles of
    :data:`~anyio_genout.text.chat_template.ROLES`, whatever the template."""
    if not messages:
        raise ApiError(400, "invalid request: messages: Cannot apply chat template to an "
                       "empty conversation. Provide at least one message.")
    for i, message in enumerate(messages):
        role = message.get("role")
        if isinstance(role, str) and role not in ROLES:
            raise ApiError(400, f"invalid request: messages[{i}].role: must be one of "
                           f"{', '.join(ROLES)}, not {role!r}")


def chat_role(body: ChatCompletionRequest) -> str:
    """The answer's role (``message.role``, the streamed ``delta.role``), as vLLM's
    ``get_chat_request_role``: ``assistant`` with a generation prompt, else the last
    message's role (the model goes on with that message)."""
    if body.add_generation_prompt or not body.messages:
        return "assistant"
    role = body.messages[-1].get("role")
    return role if isinstance(role, str) else "assistant"


def _echo_text(body: ChatCompletionRequest) -> str:
    """vLLM's chat ``echo``: the last message's content, when its role is the answer's
    (:func:`chat_role`)."""
    last = body.messages[-1]
    content = last.get("content")
    if last.get("role") != chat_role(body) or not content:
        return ""
    if isinstance(content, list):
        return "\n".join(part["text"] for part in content
                         if isinstance(part, dict) and isinstance(part.get("text"), str))
    return content if isinstance(content, str) else ""


def chat_kwargs(kwargs: dict[str, Any] | None, *, continue_final_message: bool,
                add_generation_prompt: bool, documents: list[dict[str, str]] | None = None
                ) -> dict[str, Any] | None:
    """The template variables with ``documents`` and ``continue_final_message`` put in;
    raises ApiError (400) for ``continue_final_message`` with ``add_generation_prompt``."""
    if continue_final_message:
        if add_generation_prompt:
            raise ApiError(400, "invalid request: continue_final_message: Cannot set both "
                           "`continue_final_message` and `add_generation_prompt` to True.",
                           "continue_final_message")
        kwargs = {**(kwargs or {}), "continue_final_message": True}
    if documents is not None:
        kwargs = {**(kwargs or {}), "documents": documents}
    return kwargs


def chat_request(body: ChatCompletionRequest, *, trust_request_chat_template: bool = False,
                 tool_serving: ToolServing | None = None) -> TextRequest:
    """The request of a ``/v1/chat/completions`` body (its ``sampling_params.logprobs`` is
    how many alternatives to show, None without ``logprobs``); a template of the request's
    own (``chat_template``, or in ``chat_template_kwargs``) only if
    ``trust_request_chat_template``; tools as :func:`chat_choices` takes them. Raises
    ApiError (400) naming the field."""
    return _chat_request(body, trust_request_chat_template, tool_serving or ToolServing())[0]


def _chat_request(body: ChatCompletionRequest, trust_request_chat_template: bool,
                  tool_serving: ToolServing) -> tuple[TextRequest, ToolPlan]:
    _check_messages(body.messages)
    check_unicode(body.messages, "messages")
    check_unicode(body.tools, "tools")
    check_unicode(body.documents, "documents")
    kwargs = template_kwargs(body.chat_template, body.chat_template_kwargs,
                             trusted=trust_request_chat_template)
    top = (body.top_logprobs or 0) if body.logprobs else None
    if body.top_logprobs not in (None, 0) and not body.logprobs:  # 0 passes, as in vLLM
        raise ApiError(400, "invalid request: top_logprobs: needs logprobs=true",
                       "top_logprobs")
    plan = plan_tools(body, tool_serving, template_kwargs=kwargs,
                      constraint=_constraint(body))
    params = _sampling(body, body.max_completion_tokens or body.max_tokens, top)
    if body.echo and body.prompt_logprobs is None:
        # vLLM's to_sampling_params: echo asks the prompt's logprobs, top_logprobs of them.
        params = attrs.evolve(params, prompt_logprobs=body.top_logprobs or 0)
    if plan.schema is not None:  # required / a named function: JSON, as vLLM builds it
        params = attrs.evolve(params, structured_outputs=StructuredOutputsParams(
            json=plan.schema))
    kwargs = chat_kwargs(kwargs, continue_final_message=body.continue_final_message,
                         add_generation_prompt=body.add_generation_prompt,
                         documents=body.documents)
    if plan.template_kwargs:
        kwargs = {**(kwargs or {}), **plan.template_kwargs}
    request = TextRequest(
        request_id=_request_id("chatcmpl", body), messages=body.messages,
        sampling_params=params,
        stop=_stop(body), include_stop_str_in_output=body.include_stop_str_in_output,
        skip_special_tokens=body.skip_special_tokens and not plan.keep_special_tokens,
        spaces_between_special_tokens=body.spaces_between_special_tokens,
        add_generation_prompt=body.add_generation_prompt,
        add_special_tokens=body.add_special_tokens,
        chat_template_kwargs=kwargs, bad_words=tuple(body.bad_words),
        truncate_prompt_tokens=body.truncate_prompt_tokens,
        truncation_side=body.truncation_side)
    return request, plan
