"""Tool calls and reasoning in chat completions, as vLLM 0.32's ``OpenAIServingChat`` does
them (docs/server.md, "Tool calls and reasoning").

* :class:`ToolServing`: the server's ``--enable-auto-tool-choice``, ``--tool-call-parser``
  and ``--reasoning-parser``, resolved once;
* :func:`plan_tools`: a chat body's ``tools``, ``tool_choice``, ``parallel_tool_calls``,
  ``include_reasoning`` and ``reasoning_effort`` checked (a 400 naming the field, in
  vLLM's words) and turned into what the request needs: the tool dicts for the chat
  template, the JSON schema the engine must hold the output to (``required``, a named
  function), and the :class:`ChatParsing` its output goes through;
* :class:`ChatParsing`: one request's parsing, used by
  :class:`~anyio_genout.server.chat_format.ChatFormat` for the whole message and each
  streamed delta.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

import attrs

from ..errors import InvalidRequestError
from ..parsers import (
    DeltaMessage,
    OutputParser,
    OutputStream,
    ParsedOutput,
    ReasoningParser,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    reasoning_parser_class,
    tool_choice_json_schema,
    tool_parser,
)
from ..parsers.hermes import HermesToolParser
from ..parsers.mistral import MistralToolParser
from ..parsers.qwen3_xml import Qwen3XmlToolParser
from ..parsers.reasoning import Qwen3ReasoningParser
from .errors import ApiError

__all__ = ["AUTO_NEEDS_FLAGS", "ChatParsing", "ToolPlan", "ToolServing", "check_tools",
           "plan_tools",
           "tool_call_json", "tool_delta_json"]

#: vLLM's answer to ``tool_choice="auto"`` (or tools without a tool_choice) on a server
#: started without ``--enable-auto-tool-choice --tool-call-parser``.
AUTO_NEEDS_FLAGS: Final = ('"auto" tool choice requires --enable-auto-tool-choice and '
                           "--tool-call-parser to be set")
_CORRECT_USAGE: Final = ('Correct usage: `{"type": "function", "function": {"name": '
                         '"my_function"}}`')
#: The values vLLM 0.32 takes for ``reasoning_effort``.
REASONING_EFFORTS: Final = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


def _refuse(message: str, param: str) -> ApiError:
    return ApiError(400, message, param)


@attrs.frozen
class ToolServing:
    """The server's parsers: ``tool_parser`` (``--tool-call-parser``; used for
    ``tool_choice="auto"`` only with ``enable_auto_tool_choice``) and ``reasoning``
    (``--reasoning-parser``'s class)."""

    tool_parser: ToolParser | None = None
    reasoning: type[ReasoningParser] | None = None
    enable_auto_tool_choice: bool = False

    @classmethod
    def from_names(cls, tool_call_parser: str | None = None,
                   reasoning_parser: str | None = None, *,
                   enable_auto_tool_choice: bool = False) -> ToolServing:
        """The parsers of those names (see :mod:`anyio_genout.parsers.registry`).

        Raises:
            InvalidRequestError: an unknown name (the message lists the known ones), or
                ``enable_auto_tool_choice`` without a tool parser.
        """
        if enable_auto_tool_choice and tool_call_parser is None:
            raise InvalidRequestError("tool_call_parser", "--enable-auto-tool-choice "
                                      "requires --tool-call-parser")
        return cls(None if tool_call_parser is None else tool_parser(tool_call_parser),
                   None if reasoning_parser is None
                   else reasoning_parser_class(reasoning_parser),
                   enable_auto_tool_choice)

    @property
    def auto(self) -> bool:
        """Whether ``tool_choice="auto"`` is served (vLLM: both flags given)."""
        return self.enable_auto_tool_choice and self.tool_parser is not None

    @property
    def parses(self) -> bool:
        """Whether chat outputs go through a parser at all (vLLM's ``parser_cls``)."""
        return self.auto or self.reasoning is not None


def tool_call_json(call: ToolCall) -> dict[str, Any]:
    """``message.tool_calls[i]`` as vLLM sends it."""
    return {"id": call.id, "type": call.type,
            "function": {"name": call.name, "arguments": call.arguments}}


def tool_delta_json(pieces: Sequence[ToolCallDelta]) -> list[dict[str, Any]]:
    """``delta.tool_calls``: one entry per call index, only the fields set (vLLM's
    ``exclude_unset``): the first piece of a call carries ``id``, ``type`` and
    ``function.name``, the later ones ``function.arguments`` text to append."""
    merged: list[dict[str, Any]] = []
    for piece in pieces:
        if merged and merged[-1]["index"] == piece.index:
            entry = merged[-1]
        else:
            entry = {"index": piece.index}
            merged.append(entry)
        if piece.id is not None:
            entry["id"] = piece.id
        if piece.type is not None:
            entry["type"] = piece.type
        function = entry.setdefault("function", {})
        if piece.name is not None:
            function["name"] = piece.name
        if piece.arguments is not None:
            function["arguments"] = function.get("arguments", "") + piece.arguments
    return merged


@attrs.frozen
class ChatParsing:
    """How one chat request's output is read: ``parser`` (reasoning first, then tool
    calls, in vLLM's order), the request's ``tool_choice`` kind (``mode``: ``"none"``,
    ``"auto"``, ``"required"`` or ``"named"``), whether more than one call is kept
    (``parallel_tool_calls``), whether reasoning is shown (``include_reasoning``) and
    whether the logprobs are hidden (``hide_logprobs``: vLLM hides them with the reasoning
    whenever the server has a parser)."""

    parser: OutputParser
    mode: str
    parallel_tool_calls: bool = True
    include_reasoning: bool = True
    hide_logprobs: bool = False

    @property
    def shows_reasoning_field(self) -> bool:
        return self.parser.reasoning is not None

    def reasoning_ended(self, prompt: str | None) -> bool:
        reasoning = self.parser.reasoning
        return reasoning is not None and prompt is not None \
            and reasoning.prompt_ends_reasoning(prompt)

    def whole(self, text: str, prompt: str | None) -> ParsedOutput:
        """The whole output split (reasoning dropped unless shown; one call at most without
        ``parallel_tool_calls``; ``required`` and named: content ``""`` for none, as
        vLLM's message has it)."""
        parsed = self.parser.extract(text, reasoning_ended=self.reasoning_ended(prompt))
        calls = parsed.tool_calls if self.parallel_tool_calls else parsed.tool_calls[:1]
        content = parsed.content
        if self.mode in ("required", "named"):
            content = content or ""
        return ParsedOutput(parsed.reasoning if self.include_reasoning else None, content,
                            calls)

    def finish_reason(self, reason: str | None, *, called: bool) -> str | None:
        """vLLM's ``finish_reason`` once calls were (``called``) or were not produced:
        ``tool_calls`` for ``auto`` with calls and for ``required`` ending with ``stop``;
        a named function keeps ``stop``."""
        if reason == "stop" and called and self.mode in ("auto", "required"):
            return "tool_calls"
        return reason

    def stream(self) -> ChatStream:
        return ChatStream(self)


class ChatStream:
    """One streamed choice: :meth:`delta` for each output, its text and whether it is the
    last. Work per output is what :class:`~anyio_genout.parsers.OutputStream` does with the
    new text."""

    def __init__(self, parsing: ChatParsing) -> None:
        self._parsing = parsing
        self._stream: OutputStream | None = None
        #: Whether a tool call piece was sent (the finish becomes ``tool_calls``).
        self.called = False

    def delta(self, text: str, token_ids: Sequence[int], prompt: str | None, *,
              last: bool) -> DeltaMessage | None:
        parsing = self._parsing
        if self._stream is None:
            self._stream = parsing.parser.stream(reasoning_ended=parsing.reasoning_ended(prompt))
        stream = self._stream
        delta = stream.push(text, token_ids) if text else None
        if last:
            delta = _join(delta, stream.finish())
        if delta is None:
            return None
        pieces = delta.tool_calls
        if not parsing.parallel_tool_calls:
            pieces = tuple(p for p in pieces if p.index == 0)
        if pieces:
            self.called = True
        reasoning = delta.reasoning if parsing.include_reasoning else None
        found = DeltaMessage(content=delta.content, reasoning=reasoning, tool_calls=pieces)
        return found if found else None


def _join(a: DeltaMessage | None, b: DeltaMessage | None) -> DeltaMessage | None:
    if a is None or b is None:
        return a or b
    return DeltaMessage(content=((a.content or "") + (b.content or "")) or None,
                        reasoning=((a.reasoning or "") + (b.reasoning or "")) or None,
                        tool_calls=a.tool_calls + b.tool_calls)


@attrs.frozen
class ToolPlan:
    """What a chat body's tool and reasoning fields ask of its request."""

    #: Template variables to add (``tools``, ``reasoning_effort``, ``enable_thinking``).
    template_kwargs: dict[str, Any] = attrs.field(factory=dict)
    #: The JSON schema the output is held to (``required`` or a named function).
    schema: dict[str, Any] | None = None
    #: How the output is read (None: as plain text, no parser).
    parsing: ChatParsing | None = None
    #: Decode with special tokens kept (the tool parser's vLLM ``adjust_request``).
    keep_special_tokens: bool = False


def check_tools(tools: Any) -> list[dict[str, Any]]:
    """The tools as the template gets them (transformers' shape: ``{"type": "function",
    "function": {"name", "description", "parameters", ...}}``); raises ApiError (400)
    naming the bad part."""
    if not isinstance(tools, list):
        raise _refuse(f"invalid request: tools: must be a list of tools, not "
                      f"{type(tools).__name__}", "tools")
    if not tools:
        raise _refuse("`tools` must not be an empty array. Either provide at least one tool "
                      "or omit the field entirely.", "tools")
    found = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, Mapping):
            raise _refuse(f"invalid request: {where}: must be an object, not "
                          f"{type(tool).__name__}", where)
        if tool.get("type", "function") != "function":
            raise _refuse(f"invalid request: {where}.type: must be 'function', not "
                          f"{tool.get('type')!r}", f"{where}.type")
        function = tool.get("function")
        if not isinstance(function, Mapping):
            raise _refuse(f"invalid request: {where}.function: must be an object with a name",
                          f"{where}.function")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise _refuse(f"invalid request: {where}.function.name: must be a non-empty "
                          "string", f"{where}.function.name")
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise _refuse(f"invalid request: {where}.function.description: must be a string",
                          f"{where}.function.description")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, Mapping):
            raise _refuse(f"invalid request: {where}.function.parameters: must be a JSON "
                          f"schema object, not {type(parameters).__name__}",
                          f"{where}.function.parameters")
        flags: dict[str, bool] = {}
        for key, value in (("strict", function.get("strict")),
                           ("defer_loading", function.get("defer_loading"))):
            if value is not None and not isinstance(value, bool):
                raise _refuse(f"invalid request: {where}.function.{key}: must be a boolean",
                              f"{where}.function.{key}")
            if value is not None:
                flags[key] = value
        deferred = tool.get("defer_loading")
        if deferred is not None and not isinstance(deferred, bool):
            raise _refuse(f"invalid request: {where}.defer_loading: must be a boolean",
                          f"{where}.defer_loading")
        if deferred is not None:
            flags.setdefault("defer_loading", deferred)
        # vLLM's ChatCompletionToolsParam.model_dump(): its fields only, the flags if set
        entry: dict[str, Any] = {"type": "function", "function": {
            "name": name, "description": description,
            "parameters": None if parameters is None else dict(parameters), **flags}}
        if deferred is not None:
            entry["defer_loading"] = deferred
        found.append(entry)
    return found


def _check_choice(choice: Any, tools: list[dict[str, Any]] | None) -> tuple[str, str | None]:
    """``(mode, named function)`` of a given ``tool_choice``, checked as vLLM's
    ``check_tool_usage``."""
    if choice is None or choice == "none":
        return "none", None
    if tools is None:
        raise _refuse("When using `tool_choice`, `tools` must be set.", "tool_choice")
    if isinstance(choice, str) and choice in ("auto", "required"):
        return choice, None
    if not isinstance(choice, Mapping):
        raise _refuse(f"Invalid value for `tool_choice`: {choice}! Only named tools, "
                      '"none", "auto" or "required" are supported.', "tool_choice")
    if choice.get("type", "function") != "function":
        raise _refuse(f"invalid request: tool_choice.type: must be 'function', not "
                      f"{choice.get('type')!r}", "tool_choice.type")
    function = choice.get("function")
    if not isinstance(function, Mapping):
        raise _refuse(f"Invalid value for `function`: `{function}` in `tool_choice`! "
                      f"{_CORRECT_USAGE}", "tool_choice.function")
    if "name" not in function:
        raise _refuse(f"Expected field `name` in `function` in `tool_choice`! "
                      f"{_CORRECT_USAGE}", "tool_choice.function.name")
    name = function["name"]
    if not isinstance(name, str) or not name:
        raise _refuse(f"Invalid `name` in `function`: `{name}` in `tool_choice`! "
                      f"{_CORRECT_USAGE}", "tool_choice.function.name")
    if all(tool["function"]["name"] != name for tool in tools):
        raise _refuse("The tool specified in `tool_choice` does not match any of the "
                      "specified `tools`", "tool_choice")
    return "named", name


def plan_tools(body: Any, serving: ToolServing, *, template_kwargs: Mapping[str, Any] | None,
               constraint: str | None) -> ToolPlan:
    """Check a chat body's tool and reasoning fields and plan its request (see
    :class:`ToolPlan`). ``template_kwargs`` are the body's own template variables (for
    ``enable_thinking``); ``constraint`` names its structured-output field, if any.

    Raises ApiError (400) naming the field: ``tools`` (not a list, empty, or a bad tool:
    ``tools[i].function.name``, ...), ``tool_choice`` (without tools, an unknown value, a
    function not among the tools, ``auto`` on a server without
    ``--enable-auto-tool-choice``), ``parallel_tool_calls``, ``include_reasoning``,
    ``reasoning_effort``, or the constraint's field when it meets ``required`` or a
    named function.
    """
    given = body.model_fields_set
    tools = None if body.tools is None else check_tools(body.tools)
    if "tool_choice" in given:
        mode, named = _check_choice(body.tool_choice, tools)
    else:
        mode, named = ("auto" if tools else "none"), None
    if mode == "auto" and not serving.auto:
        raise _refuse(AUTO_NEEDS_FLAGS, "tool_choice")
    if body.parallel_tool_calls is not None and not isinstance(body.parallel_tool_calls, bool):
        raise _refuse("invalid request: parallel_tool_calls: must be a boolean",
                      "parallel_tool_calls")
    effort = body.reasoning_effort
    if effort is not None and effort not in REASONING_EFFORTS:
        raise _refuse(f"invalid request: reasoning_effort: must be one of "
                      f"{', '.join(REASONING_EFFORTS)}, not {effort!r}", "reasoning_effort")
    schema = None
    if mode in ("required", "named"):
        if constraint is not None:
            raise _refuse(f"invalid request: {constraint}: You can only either use "
                          "constraints for structured outputs or tools, not both.",
                          constraint)
        try:
            schema = tool_choice_json_schema(
                {"type": "function", "function": {"name": named}} if named else mode,
                tools, body.parallel_tool_calls)
        except InvalidRequestError as exc:
            raise _refuse(f"invalid request: {exc}", exc.field or "tools") from None
    extra: dict[str, Any] = {}
    if tools is not None:
        extra["tools"] = tools
    if effort is not None:
        extra["reasoning_effort"] = effort
        if "enable_thinking" not in (template_kwargs or {}):
            extra["enable_thinking"] = effort != "none"
    parsing = None
    if serving.parses or mode in ("required", "named"):
        thinking = {**(template_kwargs or {}), **extra}.get("enable_thinking", True)
        reasoning = None if serving.reasoning is None \
            else serving.reasoning(thinking=thinking is not False)
        parser = OutputParser(serving.tool_parser if serving.auto else None, reasoning,
                              "auto" if mode == "named" else mode, named)
        parsing = ChatParsing(parser, mode, body.parallel_tool_calls is not False,
                              bool(body.include_reasoning),
                              serving.parses and not body.include_reasoning)
    return ToolPlan(extra, schema, parsing, _keeps_special_tokens(serving, mode, tools))


def _keeps_special_tokens(serving: ToolServing, mode: str,
                          tools: list[dict[str, Any]] | None) -> bool:
    """Whether vLLM 0.32's parsers decode this request with special tokens kept (their
    ``adjust_request``, run when the server has a parser and the request has reasoning
    to read or a ``tool_choice`` other than none): the engine-based ones (``qwen3``
    reasoning, ``qwen3_xml``) always, hermes and mistral when tools are in play (hermes's
    markers are special tokens in some tokenizers, mistral's ``[TOOL_CALLS]`` is one in
    all of them; vLLM keeps it for a tokenizer that is not mistral-common's, which none
    here is)."""
    if not serving.parses or (serving.reasoning is None and mode == "none"):
        return False
    tool = serving.tool_parser if serving.auto else None
    return (serving.reasoning is not None and issubclass(serving.reasoning,
                                                         Qwen3ReasoningParser)) \
        or isinstance(tool, Qwen3XmlToolParser) \
        or (isinstance(tool, HermesToolParser | MistralToolParser) and tools is not None
            and mode != "none")
