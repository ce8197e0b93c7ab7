"""Tool-call and reasoning parsers, as vLLM 0.32's (``--tool-call-parser``,
``--reasoning-parser``), sans I/O: text in, content, reasoning and tool calls out.

* :func:`tool_parser` (``hermes``, ``qwen3_json``, ``llama3_json``, ``llama4_json``,
  ``mistral``, ``pythonic``, ``qwen3_xml``, ``qwen3_coder``, ``deepseek_v3``, or a
  plugin's) and
  :func:`reasoning_parser_class` (``deepseek_r1``, ``qwen3``, or a plugin's): see
  :mod:`.registry`;
* :class:`OutputParser` puts them together with a request's ``tool_choice``:
  ``extract(text)`` for a whole output, ``stream()`` for a per-request state whose
  ``push(delta_text, delta_token_ids)`` returns each :class:`DeltaMessage`;
* :func:`tool_choice_json_schema`: the structured-output schema of ``tool_choice="required"``
  or a named function.

Imports nothing but the standard library, attrs and :mod:`anyio_genout.errors`. See
docs/server.md, "Tool calls and reasoning".
"""

from .base import PartialCall, Snapshot, ToolCallStream, ToolParser
from .compose import OutputParser, OutputStream
from .mistral import MistralToolParser
from .reasoning import ReasoningParser, ReasoningStream, ReasoningTokenCounter
from .registry import (
    reasoning_parser_class,
    reasoning_parser_names,
    tool_parser,
    tool_parser_names,
)
from .schema import tool_choice_json_schema
from .types import DeltaMessage, ParsedOutput, ToolCall, ToolCallDelta, ToolCallsResult

__all__ = ["DeltaMessage", "MistralToolParser", "OutputParser", "OutputStream",
           "ParsedOutput", "PartialCall", "ReasoningParser", "ReasoningStream",
           "ReasoningTokenCounter", "Snapshot",
           "ToolCall", "ToolCallDelta", "ToolCallStream", "ToolCallsResult", "ToolParser",
           "reasoning_parser_class", "reasoning_parser_names", "tool_choice_json_schema",
           "tool_parser", "tool_parser_names"]
