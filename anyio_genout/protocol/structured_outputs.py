"""``StructuredOutputsParams``: vLLM's structured-output constraint, its checks and wire map.

One constraint per request (a JSON Schema, a regular expression, a list of choices, a
grammar, "any JSON object" or a structural tag): the engine compiles it with its grammar
backend and masks every sampling step with it. The engine needs its tokenizer for that: it
must not run with ``--skip-tokenizer-init``.

On the wire (the ``structured_outputs`` key of the SamplingParams map) this is a map of all
eleven fields of vLLM 0.32's dataclass, defaults included, as vLLM's msgspec encoder writes
it after vLLM's front end has filled in what the engine relies on:

* ``_backend="xgrammar"``, ``_backend_was_auto=True``: the front end's default backend
  ``auto`` resolves to xgrammar for every constraint xgrammar handles. The engine builds its
  one grammar backend from the ``_backend`` of the first structured request it sees (without
  one that request fails) and uses it for every later request, whatever they say.
* a ``choice`` list travels as its ``grammar`` (:func:`choice_as_grammar`): vLLM's xgrammar
  validation rewrites it so, and the engine's xgrammar backend compiles no choice lists.

:meth:`StructuredOutputsParams.validate` makes the checks vLLM's front end makes, so that
nothing the engine would refuse is sent; schemas are checked with ``jsonschema`` once per
distinct schema text.
"""

from __future__ import annotations

import functools
import json as _json
import math
import warnings
from collections.abc import Iterable, Mapping
from typing import Any, Final

import attrs

from ..errors import InvalidRequestError
from .validation import INT64_MIN, UINT64_MAX, check_text, safe_repr, short_int

__all__ = ["BACKEND", "MAX_JSON_NESTING", "StructuredOutputsParams", "choice_as_grammar",
           "memoizable"]

#: ``_backend`` as vLLM's front end sets it (backend ``auto``, resolved to xgrammar).
BACKEND: Final = "xgrammar"
#: vLLM's limit on nested objects and arrays in a schema; a structural tag gets 16 more.
MAX_JSON_NESTING: Final = 64
_TAG_NESTING: Final = MAX_JSON_NESTING + 16
_FIELD: Final = "structured_outputs"
_KINDS: Final = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
#: The string formats vLLM lets xgrammar enforce (others go to another backend in vLLM).
_STRING_FORMATS: Final = frozenset({
    "email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid",
    "uri", "uri-reference", "uri-template", "json-pointer", "relative-json-pointer",
})


def _choices(value: Iterable[str] | None) -> tuple[str, ...] | None:
    if value is None or type(value) is tuple:
        return value
    if not isinstance(value, str | bytes | Mapping):
        try:
            return tuple(value)
        except TypeError:
            pass
    raise InvalidRequestError(f"{_FIELD}.choice",
                              f"must be a list of strings, got {type(value).__name__}")


@attrs.frozen(kw_only=True)
class StructuredOutputsParams:
    """A structured-output constraint (vLLM's ``StructuredOutputsParams``, same fields).

    Exactly one of ``json`` (a JSON Schema: a mapping or its JSON text), ``regex``,
    ``choice``, ``grammar`` (EBNF or Lark, as xgrammar reads it), ``json_object`` (``True``:
    any JSON object) and ``structural_tag`` (JSON text) is set. ``disable_any_whitespace``,
    ``disable_additional_properties`` and ``whitespace_pattern`` are sent as vLLM sends them;
    vLLM 0.32's engines read these options from their own configuration instead.

    Construction only converts ``choice`` to a tuple; :meth:`validate` checks the rest.

    Raises:
        InvalidRequestError: ``choice`` is not a sequence (or is a single string).
    """

    json: str | Mapping[str, Any] | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = attrs.field(default=None, converter=_choices)
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def validate(self) -> None:
        """Raise :class:`InvalidRequestError` for what vLLM's front end would refuse.

        The error names the field: ``"structured_outputs"`` for no constraint or several,
        else e.g. ``"structured_outputs.json"``, ``"structured_outputs.choice[2]"``.
        """
        kinds = [kind for kind in _KINDS if getattr(self, kind) is not None]
        if len(kinds) != 1:
            raise InvalidRequestError(_FIELD, (
                "you can only use one kind of structured outputs constraint but multiple are "
                f"specified: {', '.join(kinds)}") if kinds else (
                "you must use one kind of structured outputs constraint (json, regex, choice, "
                "grammar, json_object or structural_tag) but none are specified"))
        for option in ("disable_any_whitespace", "disable_additional_properties"):
            if type(getattr(self, option)) is not bool:
                raise InvalidRequestError(f"{_FIELD}.{option}", "must be a bool")
        if self.whitespace_pattern is not None:
            check_text(self.whitespace_pattern, f"{_FIELD}.whitespace_pattern")
        field = f"{_FIELD}.{kinds[0]}"
        value: Any = getattr(self, kinds[0])
        if kinds[0] == "json":
            problem = _schema_problem(_schema_text(value, field))
            if problem is not None:
                raise InvalidRequestError(field, problem)
        elif kinds[0] == "regex":
            check_text(value, field)
            # An empty regex is valid (it matches the empty text), as in vLLM.
            if "\x00" in value:
                raise InvalidRequestError(field, "must not contain a NUL character ('\\x00')")
        elif kinds[0] == "choice":
            if not value:
                raise InvalidRequestError(field, "must not be an empty list")
            for i, choice in enumerate(value):
                check_text(choice, f"{field}[{i}]")
        elif kinds[0] == "grammar":
            _check_nonblank(value, field)
        elif kinds[0] == "json_object":
            if value is not True:
                raise InvalidRequestError(field, "must be True if set; omit "
                                          "structured_outputs to disable structured outputs")
        else:
            _check_structural_tag(value, field)

    def to_wire(self) -> dict[str, Any]:
        """The map vLLM's engine decodes: every field, a ``choice`` as its ``grammar``, and
        ``_backend``/``_backend_was_auto`` as vLLM's front end sets them. Not validated.

        Raises:
            InvalidRequestError: ``json`` is a mapping holding what JSON cannot.
        """
        schema = self.json
        if isinstance(schema, Mapping):
            schema = _plain(schema, f"{_FIELD}.json", 1)
        grammar = self.grammar
        choice = self.choice
        if choice is not None:
            grammar, choice = choice_as_grammar(choice), None
        return {
            "json": schema,
            "regex": self.regex,
            "choice": choice,
            "grammar": grammar,
            "json_object": self.json_object,
            "disable_any_whitespace": self.disable_any_whitespace,
            "disable_additional_properties": self.disable_additional_properties,
            "whitespace_pattern": self.whitespace_pattern,
            "structural_tag": self.structural_tag,
            "_backend": BACKEND,
            "_backend_was_auto": True,
        }

    @classmethod
    def from_wire(cls, wire: Mapping[str, Any]) -> StructuredOutputsParams:
        """Rebuild from a wire map (engine side; ``_backend`` and unknown keys ignored).

        Raises:
            InvalidRequestError: ``choice`` is not a sequence.
        """
        return cls(
            json=wire.get("json"),
            regex=wire.get("regex"),
            choice=wire.get("choice"),
            grammar=wire.get("grammar"),
            json_object=wire.get("json_object"),
            disable_any_whitespace=wire.get("disable_any_whitespace", False),
            disable_additional_properties=wire.get("disable_additional_properties", False),
            whitespace_pattern=wire.get("whitespace_pattern"),
            structural_tag=wire.get("structural_tag"),
        )


def memoizable(params: StructuredOutputsParams | None) -> bool:
    """Whether a check or wire map of ``params`` stays true: not with a mapping ``json``,
    whose contents the caller could change."""
    return params is None or (isinstance(params, StructuredOutputsParams)
                              and not isinstance(params.json, Mapping))


def choice_as_grammar(choices: Iterable[str]) -> str:
    """vLLM's ``choice_as_grammar``: ``root ::= "a" | "b"``, each choice an EBNF literal."""
    return "root ::= " + " | ".join(f'"{_ebnf_escape(c)}"' for c in choices)


_EBNF_ESCAPES: Final = {"\\": r"\\", '"': r"\"", "\n": r"\n", "\r": r"\r", "\t": r"\t"}


def _ebnf_escape(text: str) -> str:
    out = []
    for ch in text:
        escaped = _EBNF_ESCAPES.get(ch)
        if escaped is None and (ord(ch) < 0x20 or ord(ch) == 0x7F):
            escaped = f"\\u{ord(ch):04x}"
        out.append(ch if escaped is None else escaped)
    return "".join(out)


def _check_nonblank(value: object, field: str) -> None:
    check_text(value, field)
    assert isinstance(value, str)
    if not value.strip():
        raise InvalidRequestError(field, "cannot be an empty string")


def _too_deep(limit: int) -> str:
    return f"is nested too deeply: objects and arrays may nest at most {limit} levels"


def _plain(value: object, field: str, depth: int, limit: int = MAX_JSON_NESTING) -> Any:
    """A copy of JSON data as plain dicts and lists; ``depth`` counts this container."""
    if type(value) is str:
        check_text(value, field)
        return value
    if value is None or type(value) is bool:
        return value
    if type(value) is int:
        if not INT64_MIN <= value <= UINT64_MAX:
            raise InvalidRequestError(field, f"integers must fit in 64 bits, got "
                                      f"{short_int(value)}")
        return value
    if type(value) is float:
        if not math.isfinite(value):
            raise InvalidRequestError(field, f"must hold only finite numbers, got {value}")
        return value
    if isinstance(value, Mapping | list | tuple):
        if depth > limit:
            raise InvalidRequestError(field, _too_deep(limit))
        if not isinstance(value, Mapping):
            return [_plain(item, field, depth + 1, limit) for item in value]
        copy = {}
        for key, item in value.items():
            if type(key) is not str:
                raise InvalidRequestError(field, f"object keys must be strings, got "
                                          f"{type(key).__name__} {safe_repr(key)}")
            check_text(key, field)
            copy[key] = _plain(item, field, depth + 1, limit)
        return copy
    raise InvalidRequestError(field, f"must hold only JSON values, got {type(value).__name__}")


def _nesting(value: object, limit: int, depth: int = 0) -> int:
    """How many objects and arrays nest in parsed JSON (counted up to ``limit + 1``)."""
    if depth > limit or not isinstance(value, dict | list):
        return depth
    items = value.values() if isinstance(value, dict) else value
    return max((_nesting(item, limit, depth + 1) for item in items), default=depth + 1)


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _parse(text: str, limit: int) -> Any:
    """JSON text (no NaN or Infinity); raises ValueError with the whole message."""
    try:
        return _json.loads(text, parse_constant=_no_constant)
    except RecursionError:
        raise ValueError(_too_deep(limit)) from None
    except ValueError as exc:
        raise ValueError(f"is not valid JSON: {exc}") from None


def _schema_text(value: object, field: str) -> str:
    """The JSON text of a schema (checked: what JSON and msgpack carry, not too deep)."""
    if isinstance(value, Mapping):
        return _json.dumps(_plain(value, field, 1))
    if not isinstance(value, str):
        raise InvalidRequestError(field, f"must be a JSON Schema (a mapping or its JSON "
                                  f"text), got {type(value).__name__}")
    _check_nonblank(value, field)
    return value


def _json_type(value: object) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(value), "number")


#: Schemas up to this long have their check remembered (256 of them at most); a longer one
#: in a cache of its own (the last 4): checking one takes seconds (jsonschema's meta-schema
#: check, 5.8 s for 860 KB), so a caller that checks it in a worker thread first (the text
#: layer, :meth:`StructuredOutputsParams.validate`) leaves only the lookup to the event loop.
_CACHED_SCHEMA_CHARS: Final = 1 << 16


def _schema_problem(text: str) -> str | None:
    """What is wrong with the schema ``text`` (``None``: nothing)."""
    if len(text) <= _CACHED_SCHEMA_CHARS:
        return _cached_schema_problem(text)
    return _cached_long_schema_problem(text)


@functools.lru_cache(maxsize=256)
def _cached_schema_problem(text: str) -> str | None:
    return _check_schema(text)


@functools.lru_cache(maxsize=4)
def _cached_long_schema_problem(text: str) -> str | None:
    return _check_schema(text)


def _check_schema(text: str) -> str | None:
    try:
        schema = _parse(text, MAX_JSON_NESTING)
    except ValueError as exc:
        return str(exc)
    if type(schema) is not dict:
        return f"must be a JSON Schema object, got a JSON {_json_type(schema)}"
    if _nesting(schema, MAX_JSON_NESTING) > MAX_JSON_NESTING:
        return _too_deep(MAX_JSON_NESTING)
    if "$schema" in schema and type(schema["$schema"]) is not str:
        return "$schema must be a string (the URI of a JSON Schema dialect)"
    from jsonschema import exceptions, validators  # type: ignore[import-untyped]

    try:
        # An unknown $schema is checked against the latest draft (as xgrammar ignores it).
        checker = validators.validator_for(schema, default=validators.Draft202012Validator)
        with warnings.catch_warnings():
            # Python's re warns about patterns it reads differently from ECMA regexes
            # ("[[:alpha:]]"); that is not the schema's problem. Once per schema text.
            warnings.simplefilter("ignore")
            checker.check_schema(schema)
    except exceptions.SchemaError as exc:
        return f"is not a valid JSON Schema: {exc.message} (at {exc.json_path})"
    except Exception as exc:  # jsonschema itself failed on it: refuse, do not crash
        return f"cannot be checked as a JSON Schema: {type(exc).__name__}: {exc}"
    unsupported = _xgrammar_unsupported(schema, "$")
    if unsupported is not None:
        return (f"uses {unsupported}, which vLLM's xgrammar backend does not enforce (vLLM "
                f"would switch to another backend; this client sends every constraint to "
                f"xgrammar)")
    return None


def _types(schema: dict[str, Any]) -> set[str]:
    kind = schema.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list):
        return {item for item in kind if isinstance(item, str)}
    return set()


def _length_with_pattern(schema: object) -> bool:
    return isinstance(schema, dict) and ("pattern" in schema or "format" in schema) and (
        "minLength" in schema or "maxLength" in schema)


def _unsupported_here(obj: dict[str, Any]) -> str | None:
    """vLLM's ``has_xgrammar_unsupported_json_features`` for one schema node."""
    types = _types(obj)
    if types & {"integer", "number"} and "multipleOf" in obj:
        return "multipleOf on a number"
    if "array" in types:
        for key in ("uniqueItems", "contains", "minContains", "maxContains"):
            if key in obj:
                return f"{key} on an array"
    if "string" in types and "format" in obj and obj["format"] not in _STRING_FORMATS:
        return f"the string format {obj['format']!r}"
    if "string" in types and _length_with_pattern(obj):
        return "minLength/maxLength with a pattern or format"
    if "object" in types and "propertyNames" in obj:
        if _length_with_pattern(obj.get("propertyNames")):
            return "propertyNames with a pattern or format and a length bound"
        for key in ("patternProperties", "properties"):
            if key in obj:
                return f"propertyNames with {key}"
        if obj.get("unevaluatedProperties", True) is not True:
            return "propertyNames with unevaluatedProperties"
    patterns = obj.get("patternProperties")
    if "object" in types and isinstance(patterns, dict):
        if "properties" in obj:
            return "patternProperties with properties"
        if len(patterns) > 1:
            return "more than one patternProperties"
    all_of = obj.get("allOf")
    if isinstance(all_of, list) and len(all_of) >= 2:
        return "allOf with more than one schema"
    return None


def _xgrammar_unsupported(obj: object, path: str) -> str | None:
    """The first schema feature xgrammar does not enforce, with its JSON path."""
    if not isinstance(obj, dict):
        return None
    found = _unsupported_here(obj)
    if found is not None:
        return f"{found} at {path}"
    for key, value in obj.items():
        items = enumerate(value) if isinstance(value, list) else ((None, value),)
        for i, item in items:
            found = _xgrammar_unsupported(item, f"{path}.{key}" if i is None
                                          else f"{path}.{key}[{i}]")
            if found is not None:
                return found
    return None


def _check_structural_tag(value: object, field: str) -> None:
    _check_nonblank(value, field)
    assert isinstance(value, str)
    try:
        tag = _parse(value, _TAG_NESTING)
    except ValueError as exc:
        raise InvalidRequestError(field, str(exc)) from None
    if type(tag) is not dict:
        raise InvalidRequestError(field, f"must be a JSON object, got a JSON {_json_type(tag)}")
    if _nesting(tag, _TAG_NESTING) > _TAG_NESTING:
        raise InvalidRequestError(field, _too_deep(_TAG_NESTING))
    if "structures" in tag:  # the older form, which vLLM's engine unpacks itself
        structures, triggers = tag["structures"], tag.get("triggers")
        if type(structures) is not list or not all(
                type(s) is dict and type(s.get("begin")) is str and type(s.get("end")) is str
                and "schema" in s for s in structures):
            raise InvalidRequestError(field, '"structures" must be a list of objects with '
                                      '"begin", "schema" and "end"')
        if type(triggers) is not list or not all(type(t) is str for t in triggers):
            raise InvalidRequestError(field, '"triggers" must be a list of strings')
