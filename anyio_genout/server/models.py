"""The request bodies of the OpenAI routes, as pydantic models (vLLM's field names).

Validation happens here (types, ranges) and in the text and generate layers (everything
else, named by :class:`~anyio_genout.InvalidRequestError`); both answer 400 naming the
field. The two generation bodies keep the fields they do not declare (``model_extra``)
for :func:`~.fields.check_fields`: vLLM's fields we refuse answer 400, unknown ones are
logged and ignored, as vLLM's server does.
"""

from __future__ import annotations

import os
from typing import Annotated, Any, ClassVar, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

#: The most stop strings a request may list: vLLM's ``VLLM_MAX_STOP_STRINGS`` (the same
#: environment variable, read at start-up; 4 by default). Each string is searched for at
#: every token of the request.
MAX_STOP_STRINGS: Final = int(os.environ.get("VLLM_MAX_STOP_STRINGS", "4"))
#: The range of ``seed``, vLLM's (a C long).
_LONG_MIN = -(2**63)
_LONG_MAX = 2**63 - 1

# The list fields stop at their first bad item (``fail_fast``): by default pydantic goes on
# to every item and makes an error of each, and a union tries each of its list branches in
# full, so a 1 MiB body of 200,000 wrong items held the event loop for seconds.
_Ints = Annotated[list[int], Field(fail_fast=True)]
_Strs = Annotated[list[str], Field(fail_fast=True)]
_IntLists = Annotated[list[_Ints], Field(fail_fast=True)]
_Dicts = Annotated[list[dict[str, Any]], Field(fail_fast=True)]

__all__ = ["MAX_STOP_STRINGS", "ChatCompletionRequest", "CompletionRequest",
           "DetokenizeRequest", "JsonSchema", "ResponseFormat", "StreamOptions",
           "TokenizeRequest"]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")

    #: Fields whose ``null`` means their default: vLLM's model types them ``X | None``
    #: (and treats None as unset) where ours hold the value itself.
    _NULL_IS_DEFAULT: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        nulls = cls._NULL_IS_DEFAULT
        if nulls and isinstance(data, dict) and None in data.values():
            return {k: v for k, v in data.items() if v is not None or k not in nulls}
        return data


class StreamOptions(_Body):
    """``stream_options``: given (not ``{}``) only with ``stream`` true, as vLLM's
    validator has it; its other keys are kept (``model_extra``) for that check alone.
    ``continuous_usage_stats`` (with ``include_usage``): every chunk carries the usage so
    far, as vLLM's do."""

    model_config = ConfigDict(extra="allow")
    _NULL_IS_DEFAULT = frozenset({"include_usage", "continuous_usage_stats"})

    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchema(_Body):
    """``response_format.json_schema``: the schema is under ``schema`` (as OpenAI sends it)."""

    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """``response_format``: ``text`` (no constraint), ``json_object`` or ``json_schema``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class _Sampling(_Body):
    """The fields completions and chat completions share."""

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    #: Tokens per streamed chunk at least (the first and the last at once), as vLLM's.
    stream_interval: int | None = Field(default=None, ge=1)
    n: int = Field(default=1, ge=1)
    temperature: float | None = Field(default=None, ge=0.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = Field(default=None, ge=_LONG_MIN, le=_LONG_MAX)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS,
                                           fail_fast=True)] | None = None
    stop_token_ids: _Ints | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    request_id: str | None = None
    response_format: ResponseFormat | None = None
    #: vLLM's extension: the fields of its StructuredOutputsParams (checked on entering).
    structured_outputs: dict[str, Any] | None = None
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: _Ints | None = None
    prompt_logprobs: int | None = Field(default=None, ge=-1)
    return_tokens_as_token_ids: bool | None = None
    #: Words never generated (the text layer turns them into vLLM's token sequences).
    bad_words: _Strs = Field(default_factory=list)
    #: Keep only that many prompt tokens (-1: the context less one), cut on
    #: ``truncation_side`` ("left" keeps the last ones, "right" the first ones).
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    truncation_side: Literal["left", "right"] | None = None
    # Ignored as vLLM's server ignores them (fields.IGNORED), but typed as vLLM types them,
    # so that a value vLLM refuses is refused here too.
    user: str | None = None
    length_penalty: float = 1.0
    routed_experts_prompt_start: int = Field(default=0, ge=0)
    mm_payload: Literal["tensors", "none"] = "tensors"


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: ``prompt`` is a string, token ids, or a list of one."""

    model_config = ConfigDict(extra="allow")
    _NULL_IS_DEFAULT = frozenset({"stream", "echo"})

    prompt: str | _Ints | _Strs | _IntLists
    #: At least 1; 0 only with ``echo``: vLLM's prompt-only echo (requests.completion_choices).
    max_tokens: int | None = Field(default=16, ge=0)
    #: -1 (vLLM's "every token") passes the model to be refused by name (:mod:`.fields`).
    logprobs: int | None = Field(default=None, ge=-1)
    echo: bool = False
    add_special_tokens: bool = True


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``: ``messages`` go through the model's chat template."""

    model_config = ConfigDict(extra="allow")
    _NULL_IS_DEFAULT = frozenset({"stream", "n", "logprobs", "top_logprobs"})

    #: Not empty: checked in :mod:`.requests` (param null, as vLLM's template refusal).
    messages: _Dicts
    max_completion_tokens: int | None = Field(default=None, ge=1)
    max_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    #: -1 (vLLM's "every token") passes the model to be refused by name (:mod:`.fields`).
    top_logprobs: int | None = Field(default=None, ge=-1)
    add_generation_prompt: bool = True
    #: The last message's content first in the answer (when it has the answer's role).
    echo: bool = False
    continue_final_message: bool = False
    #: Encode the rendered prompt with the tokenizer's special tokens too (vLLM: False).
    add_special_tokens: bool = False
    documents: Annotated[list[dict[str, str]], Field(fail_fast=True)] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    #: vLLM's request template: refused unless the server trusts request templates.
    chat_template: str | None = None
    #: Tool calls and reasoning (checked by :func:`~.tools.plan_tools`, which names the
    #: bad part: ``tools[0].function.name``, ``tool_choice``, ...).
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = True
    include_reasoning: bool = True
    reasoning_effort: str | None = None


class TokenizeRequest(_Body):
    """``POST /tokenize``: a ``prompt`` or chat ``messages`` (vLLM's two tokenize bodies
    in one: the chat fields apply to ``messages`` only)."""

    _NULL_IS_DEFAULT = frozenset({"return_token_strs"})

    model: str | None = None
    prompt: str | None = None
    messages: _Dicts | None = None
    #: None: vLLM's default, True for a prompt and False for messages.
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None
    tools: Any = None
    #: Refused when given (no multimodal inputs), as on chat completions.
    mm_processor_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, dict[str, Any]] | None = None


class DetokenizeRequest(_Body):
    """``POST /detokenize``: token ids back to text."""

    model: str | None = None
    tokens: _Ints


#: The ``object`` of a streamed chunk, by route.
ChunkObject = Literal["text_completion", "chat.completion.chunk"]
