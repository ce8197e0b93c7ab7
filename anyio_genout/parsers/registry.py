"""Parsers by name (vLLM 0.32's names), built in and from plugins.

A distribution adds a parser with an entry point::

    [project.entry-points."anyio_genout.tool_parsers"]
    my_format = "my_package.parsers:MyToolParser"      # a ToolParser subclass

    [project.entry-points."anyio_genout.reasoning_parsers"]
    my_think = "my_package.parsers:MyReasoningParser"  # a ReasoningParser subclass

A built-in name wins over a plugin's; plugins are looked up only for a name not built in.
"""

from __future__ import annotations

from importlib import metadata

from ..errors import InvalidRequestError
from .base import ToolParser
from .deepseek import DeepSeekV3ToolParser
from .hermes import HermesToolParser
from .llama import Llama3JsonToolParser
from .mistral import MistralToolParser
from .pythonic import PythonicToolParser
from .qwen3_xml import Qwen3XmlToolParser
from .reasoning import DeepSeekR1ReasoningParser, Qwen3ReasoningParser, ReasoningParser

__all__ = ["REASONING_PARSERS", "TOOL_PARSERS", "reasoning_parser_class", "tool_parser",
           "tool_parser_names", "reasoning_parser_names"]

TOOL_GROUP = "anyio_genout.tool_parsers"
REASONING_GROUP = "anyio_genout.reasoning_parsers"

#: Built-in tool parsers by ``--tool-call-parser`` name (aliases as vLLM 0.32 has them).
TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "qwen3_json": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "llama4_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "pythonic": PythonicToolParser,
    "deepseek_v3": DeepSeekV3ToolParser,
    "qwen3_xml": Qwen3XmlToolParser,
    "qwen3_coder": Qwen3XmlToolParser,
}
#: Built-in reasoning parsers by ``--reasoning-parser`` name.
REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "qwen3": Qwen3ReasoningParser,
}


def _plugin(group: str, name: str, base: type) -> type | None:
    for entry in metadata.entry_points(group=group, name=name):
        try:
            loaded = entry.load()
        except Exception as exc:  # a broken plugin: say which, as a usage error
            raise InvalidRequestError(group, f"plugin {name!r} ({entry.value}) failed to "
                                             f"load: {exc!r}") from None
        if not (isinstance(loaded, type) and issubclass(loaded, base)):
            raise InvalidRequestError(group, f"plugin {name!r} ({entry.value}) is not a "
                                             f"{base.__name__} subclass")
        return loaded
    return None


def _names(group: str, builtin: dict[str, type]) -> list[str]:
    return sorted(set(builtin) | {e.name for e in metadata.entry_points(group=group)})


def tool_parser_names() -> list[str]:
    """Every name :func:`tool_parser` knows, built in and from plugins."""
    return _names(TOOL_GROUP, TOOL_PARSERS)


def reasoning_parser_names() -> list[str]:
    """Every name :func:`reasoning_parser_class` knows, built in and from plugins."""
    return _names(REASONING_GROUP, REASONING_PARSERS)


def tool_parser(name: str) -> ToolParser:
    """The tool parser ``name`` (one instance serves every request).

    Raises:
        InvalidRequestError: no parser has that name, or its plugin does not load.
    """
    cls: type[ToolParser] | None = TOOL_PARSERS.get(name) or _plugin(TOOL_GROUP, name,
                                                                      ToolParser)
    if cls is None:
        raise InvalidRequestError("tool_call_parser", f"unknown tool parser {name!r}; "
                                  f"known: {', '.join(tool_parser_names())}")
    return cls()


def reasoning_parser_class(name: str) -> type[ReasoningParser]:
    """The reasoning parser class ``name``; build one per request setting,
    ``cls(thinking=...)``.

    Raises:
        InvalidRequestError: no parser has that name, or its plugin does not load.
    """
    cls: type[ReasoningParser] | None = (REASONING_PARSERS.get(name)
                                         or _plugin(REASONING_GROUP, name, ReasoningParser))
    if cls is None:
        raise InvalidRequestError("reasoning_parser", f"unknown reasoning parser {name!r}; "
                                  f"known: {', '.join(reasoning_parser_names())}")
    return cls
