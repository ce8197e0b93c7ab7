"""Every field of vLLM 0.32's completions and chat completions bodies and responses, classified.

A request field is :data:`IMPLEMENTED` (as vLLM does it), :data:`IGNORED` (accepted and
without effect, because vLLM's server ignores it too on a plain text model), or
:data:`REFUSED` (a 400 naming the field, "not supported", when it is given a value other
than vLLM's default). A field in neither of vLLM's models is ignored with a logged
warning, as vLLM's ``OpenAIBaseModel`` does. ``tests/interop/test_field_table.py`` fails
when vLLM has a field this table does not name.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping
from typing import Any, Final, Literal

from .errors import ApiError

__all__ = ["CHAT_ONLY", "COMPLETION_ONLY", "IGNORED", "IMPLEMENTED", "REFUSED", "REQUEST_FIELDS",
           "RESPONSE_FIELDS", "check_fields", "check_logprob_counts", "counts"]

_log = logging.getLogger("anyio_genout.server")

IMPLEMENTED: Final = "implemented"
IGNORED: Final = "ignored"
REFUSED: Final = "refused"
Kind = Literal["implemented", "ignored", "refused"]

_I: Final = IMPLEMENTED
_G: Final = IGNORED
_R: Final = REFUSED

#: Request fields: (kind, why). Both routes unless in COMPLETION_ONLY or CHAT_ONLY.
REQUEST_FIELDS: Final[Mapping[str, tuple[Kind, str]]] = {
    "model": (_I, "checked against the served model name"),
    "prompt": (_I, "a string, token ids, or a list of several"),
    "messages": (_I, "through the chat template; roles system, developer (a system message "
                 "for a template that does not name it, as vLLM), user, assistant, tool"),
    "stream": (_I, "server-sent events"),
    "stream_options": (_I, "include_usage, continuous_usage_stats (usage so far on every "
                       "chunk); refused without stream=true as vLLM does"),
    "n": (_I, "child requests; n > 1 refused with temperature 0 as vLLM does (param null)"),
    "temperature": (_I, ""), "top_p": (_I, ""), "top_k": (_I, ""), "min_p": (_I, ""),
    "seed": (_I, ""), "presence_penalty": (_I, ""), "frequency_penalty": (_I, ""),
    "repetition_penalty": (_I, ""), "min_tokens": (_I, ""), "ignore_eos": (_I, ""),
    "stop": (_I, "stop strings"), "stop_token_ids": (_I, ""),
    "max_tokens": (_I, ""), "max_completion_tokens": (_I, ""),
    "logprobs": (_I, "logprobs=0 shows the sampled token's entry"),
    "top_logprobs": (_I, ""),
    "prompt_logprobs": (_I, "in the whole response; refused with stream as vLLM does"),
    "logit_bias": (_I, "token id (as a string) to bias, clamped to [-100, 100] as vLLM"),
    "allowed_token_ids": (_I, ""),
    "echo": (_I, "completions: the prompt first (with max_tokens 0 the prompt alone, as "
             "vLLM); chat: the last message's content first, and the prompt's logprobs in "
             "the whole response, as vLLM"),
    "add_generation_prompt": (_I, "passed to the chat template; false: the answer has the "
                              "last message's role, as vLLM"),
    "continue_final_message": (_I, "no generation prompt, cut after the last message"),
    "documents": (_I, "the chat template's documents variable"),
    "chat_template": (_I, "only with --trust-request-chat-template"),
    "chat_template_kwargs": (_I, "template variables"),
    "add_special_tokens": (_I, ""),
    "skip_special_tokens": (_I, ""), "spaces_between_special_tokens": (_I, ""),
    "include_stop_str_in_output": (_I, ""),
    "request_id": (_I, "the response id and the engine's request id"),
    "response_format": (_I, "structured outputs"),
    "structured_outputs": (_I, "vLLM's structured outputs parameters"),
    "return_tokens_as_token_ids": (_I, "logprob tokens as 'token_id:<id>'"),
    "user": (_G, "vLLM ignores it too"),
    "priority": (_R, "priority scheduling is not passed on (vLLM too refuses a non-zero "
                 "priority unless its priority scheduling is on)"),
    "parallel_tool_calls": (_I, "false keeps the first tool call only (and required's "
                            "schema allows one)"),
    "include_reasoning": (_I, "false drops the reasoning (and the logprobs) as vLLM does"),
    "stream_interval": (_I, "at least this many tokens a streamed chunk (the first and the "
                        "last at once), the larger of it and --stream-interval, as vLLM"),
    "mm_payload": (_G, "only for multimodal outputs, which a text model has none of"),
    "routed_experts_prompt_start": (_G, "only with routed experts capture, not served"),
    "length_penalty": (_G, "beam search only; use_beam_search is refused"),
    "bad_words": (_I, "banned as vLLM bans them (each word's tokens, and with a leading "
                  "space)"),
    "truncate_prompt_tokens": (_I, "the prompt's tokens cut to that many (-1: the context "
                               "less one)"),
    "truncation_side": (_I, "left keeps the last prompt tokens, right the first"),
    "tools": (_I, "rendered by the chat template (tools=), read by --tool-call-parser"),
    "tool_choice": (_I, "none, auto (--enable-auto-tool-choice), required and a named "
                    "function (held to vLLM's JSON schema)"),
    "reasoning_effort": (_I, "chat template variables reasoning_effort and enable_thinking"),
    "thinking_token_budget": (_R, "the thinking token budget is not passed to the engine"),
    "use_beam_search": (_R, "beam search is not implemented"),
    "suffix": (_R, "vLLM refuses it too"),
    "prompt_embeds": (_R, "no embeddings input"),
    "cache_salt": (_R, "not passed to the engine by the server"),
    "kv_transfer_params": (_R, "disaggregated prefill is not supported"),
    "ec_transfer_params": (_R, "disaggregated encoders are not supported"),
    "vllm_xargs": (_R, "engine extension arguments are not passed"),
    "logprob_token_ids": (_R, "logprobs of chosen token ids are not supported"),
    "return_token_ids": (_R, "token ids in the response are not sent"),
    "return_token_offsets": (_R, "token offsets in the response are not sent"),
    "return_prompt_text": (_R, "the prompt text in the response is not sent"),
    "return_mm_kwargs": (_R, "no multimodal inputs"),
    "media_io_kwargs": (_R, "no multimodal inputs"),
    "mm_processor_kwargs": (_R, "no multimodal inputs"),
    "repetition_detection": (_R, "repetition detection is not passed to the engine"),
    "watermarking": (_R, "watermarking is not implemented"),
    "session_id": (_R, "sessions are not supported"),
}

COMPLETION_ONLY: Final = frozenset({"prompt", "suffix", "prompt_embeds"})
CHAT_ONLY: Final = frozenset({
    "messages", "max_completion_tokens", "top_logprobs", "add_generation_prompt",
    "continue_final_message", "documents", "chat_template", "chat_template_kwargs", "tools",
    "tool_choice", "parallel_tool_calls", "include_reasoning", "reasoning_effort",
    "media_io_kwargs", "mm_processor_kwargs", "return_prompt_text"})

#: Values of a refused field that mean "not used" (vLLM's defaults, or what vLLM's
#: ``to_sampling_params`` treats as unset), so accepted; null is accepted too, except for
#: the fields in :data:`_NOT_NULL`.
_HARMLESS: Final[Mapping[str, tuple[Any, ...]]] = {
    "use_beam_search": (False,),
    "return_token_offsets": (False,), "return_token_ids": (False,),
    "return_prompt_text": (False,), "return_mm_kwargs": (False,),
    "priority": (0,), "watermarking": (False,),
    "vllm_xargs": ({},), "kv_transfer_params": ({},), "ec_transfer_params": ({},),
    "logprob_token_ids": ([],),
}
#: Refused fields that vLLM's models type without None (a null is a 400 there too).
_NOT_NULL: Final = frozenset({"use_beam_search", "priority"})

#: Response fields (the whole response, its choices, the stream's chunks and choices): sent,
#: or not sent (why). Keys are "Model.field" with vLLM's model names.
RESPONSE_FIELDS: Final[Mapping[str, str]] = {
    **{f"{m}.{f}": "sent" for m in ("CompletionResponse", "CompletionStreamResponse",
                                     "ChatCompletionResponse", "ChatCompletionStreamResponse")
       for f in ("id", "object", "created", "model", "choices", "usage")},
    **{f"{m}.metrics": "not sent: vLLM sends None unless asked for it" for m in (
        "CompletionResponse", "CompletionStreamResponse", "ChatCompletionResponse",
        "ChatCompletionStreamResponse")},
    **{f"{m}.system_fingerprint": "sent (--fingerprint-mode, not with none)" for m in (
        "CompletionResponse", "ChatCompletionResponse")},
    **{f"{m}.system_fingerprint": "sent on each chunk with a finish_reason, or with "
       "stream_options.include_usage on the usage chunk alone (--fingerprint-mode, not "
       "with none)" for m in ("CompletionStreamResponse", "ChatCompletionStreamResponse")},
    **{f"{m}.{f}": "not sent: the request fields that ask for them are refused" for m, f in (
        ("CompletionResponse", "kv_transfer_params"), ("CompletionResponse", "ec_transfer_params"),
        ("ChatCompletionResponse", "kv_transfer_params"),
        ("ChatCompletionResponse", "ec_transfer_params"),
        ("ChatCompletionResponse", "prompt_token_ids"), ("ChatCompletionResponse", "prompt_text"),
        ("ChatCompletionStreamResponse", "prompt_token_ids"),
        ("ChatCompletionStreamResponse", "prompt_text"),
        ("CompletionResponseChoice", "prompt_token_ids"),
        ("CompletionResponseChoice", "token_ids"),
        ("CompletionResponseStreamChoice", "token_ids"),
        ("ChatCompletionResponseChoice", "token_ids"),
        ("ChatCompletionResponseStreamChoice", "token_ids"))},
    **{f"{m}.{f}": "not sent: no routed experts capture" for m in (
        "CompletionResponseChoice", "ChatCompletionResponseChoice") for f in ("routed_experts",)},
    **{f"{m}.service_tier": "not sent (None in vLLM)" for m in (
        "CompletionResponse", "ChatCompletionResponse")},
    "ChatCompletionResponse.prompt_logprobs": "sent",
    "CompletionResponseChoice.prompt_logprobs": "sent",
    "CompletionResponseStreamChoice.prompt_token_ids": "sent with echo, on each choice's "
    "first chunk (the prompt's ids), as vLLM",
    **{f"{m}.{f}": "sent" for m, fs in (
        ("CompletionResponseChoice", ("index", "text", "logprobs", "finish_reason",
                                      "stop_reason")),
        ("CompletionResponseStreamChoice", ("index", "text", "logprobs", "finish_reason",
                                            "stop_reason")),
        ("ChatCompletionResponseChoice", ("index", "message", "logprobs", "finish_reason",
                                          "stop_reason")),
        ("ChatCompletionResponseStreamChoice", ("index", "delta", "logprobs",
                                                "finish_reason", "stop_reason")))
       for f in fs},
}


@functools.cache
def _route_fields(chat: bool) -> frozenset[str]:
    """The fields of one route (made once: every request checks against it)."""
    other = COMPLETION_ONLY if chat else CHAT_ONLY
    return frozenset(name for name in REQUEST_FIELDS if name not in other)


def counts() -> dict[str, int]:
    """How many request fields (of both routes, each once) are of each kind."""
    found = {IMPLEMENTED: 0, IGNORED: 0, REFUSED: 0}
    for kind, _ in REQUEST_FIELDS.values():
        found[kind] += 1
    return found


def check_fields(extra: Mapping[str, Any] | None, *, chat: bool) -> None:
    """Check the fields of a body that its pydantic model did not take (``extra``): a
    refused one set to anything but its default answers 400 naming it; an ignored one
    passes; an unknown one (or one of the other route's) is logged and ignored, as vLLM does.

    Raises:
        ApiError: (400) a refused field is given, named as ``param``.
    """
    unknown: list[str] = []
    route = _route_fields(chat)
    for name, value in (extra or {}).items():
        if name not in route:
            unknown.append(name)
            continue
        kind, why = REQUEST_FIELDS[name]
        if kind != REFUSED:
            continue
        if value is None:
            if name in _NOT_NULL:
                raise ApiError(400, f"invalid request: {name}: must not be null", name)
        elif value not in _HARMLESS.get(name, ()):
            raise ApiError(400, f"invalid request: {name}: not supported ({why})", name)
    if unknown:
        _log.warning("The following fields were present in the request but ignored: %s",
                     sorted(unknown))


def check_logprob_counts(body: Any) -> None:
    """Refuse vLLM's -1 ("every token of the vocabulary") in ``logprobs``, ``top_logprobs``
    and ``prompt_logprobs``: not rendered here, so a 400 naming the field rather than an
    answer with empty rows.

    Raises:
        ApiError: (400) the field set to -1, named as ``param``.
    """
    for name in ("logprobs", "top_logprobs", "prompt_logprobs"):
        if getattr(body, name, None) == -1:  # chat's bool logprobs is never -1
            raise ApiError(400, f"invalid request: {name}: -1 (every token of the "
                           "vocabulary) is not supported; ask for at most the server's "
                           "--max-logprobs", name)


def echo_without_generation(echo: bool, max_tokens: int | None) -> bool:
    """Whether a completions body is vLLM's echo without generation (``echo`` with
    ``max_tokens`` 0: one token is generated and counted in the usage, the answer shows the
    prompt alone). Raises ApiError (400 naming ``max_tokens``) for 0 without ``echo``."""
    if max_tokens != 0:
        return False
    if not echo:
        raise ApiError(400, "invalid request: max_tokens: Input should be greater than or "
                       "equal to 1 (0 only with echo: the prompt alone)", "max_tokens")
    return True
