"""``POST /tokenize``: what a body asks to be tokenized, as vLLM's two tokenize bodies do.

A ``prompt`` is encoded with the tokenizer's special tokens unless ``add_special_tokens``
is false; chat ``messages`` are rendered as a chat completion's would be (the generation
prompt or ``continue_final_message``, ``tools``, template variables) and encoded without
them unless ``add_special_tokens`` is true. A chat field given with a ``prompt``, and the
multimodal fields, are refused (400 naming the field): none is dropped.
"""

from __future__ import annotations

from typing import Final

from ..text.request import TextRequest
from .errors import ApiError
from .models import TokenizeRequest
from .requests import chat_kwargs, check_unicode, template_kwargs
from .tools import check_tools

__all__ = ["tokenize_request"]

#: The fields of vLLM's chat tokenize body that a prompt has no use for.
_CHAT_ONLY: Final = ("add_generation_prompt", "continue_final_message", "chat_template",
                     "chat_template_kwargs", "tools")
#: Refused whenever given: there are no multimodal inputs.
_MULTIMODAL: Final = ("mm_processor_kwargs", "media_io_kwargs")


def tokenize_request(body: TokenizeRequest, *, trust_request_chat_template: bool
                     ) -> TextRequest:
    """The :class:`TextRequest` whose encoding answers ``body`` (a request template only if
    ``trust_request_chat_template``). Raises ApiError (400) naming the field."""
    if (body.prompt is None) == (body.messages is None):
        raise ApiError(400, "invalid request: prompt: give exactly one of prompt and "
                       "messages", "prompt")
    for name in _MULTIMODAL:
        if getattr(body, name) is not None:
            raise ApiError(400, f"invalid request: {name}: not supported (no multimodal "
                           "inputs)", name)
    if body.prompt is not None:
        check_unicode(body.prompt, "prompt")
        for name in _CHAT_ONLY:
            if name in body.model_fields_set:
                raise ApiError(400, f"invalid request: {name}: applies to messages, not to "
                               "a prompt", name)
        return TextRequest(prompt=body.prompt, add_special_tokens=body.add_special_tokens
                           is not False)
    check_unicode(body.messages, "messages")
    check_unicode(body.tools, "tools")
    kwargs = template_kwargs(body.chat_template, body.chat_template_kwargs,
                             trusted=trust_request_chat_template)
    kwargs = chat_kwargs(kwargs, continue_final_message=body.continue_final_message,
                         add_generation_prompt=body.add_generation_prompt)
    if body.tools is not None:
        kwargs = {**(kwargs or {}), "tools": check_tools(body.tools)}
    return TextRequest(messages=body.messages, chat_template_kwargs=kwargs,
                       add_generation_prompt=body.add_generation_prompt,
                       add_special_tokens=body.add_special_tokens is True)
