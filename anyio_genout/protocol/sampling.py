"""``SamplingParams``: what the engine samples with, its validation and its wire map.

On the wire this is a msgpack *map* keyed by vLLM's field names, default values omitted,
including the private keys ``_eos_token_id`` (without it the engine never stops on EOS),
``_all_stop_token_ids`` (stop tokens ``min_tokens`` must hold back) and
``_bad_words_token_ids``. :meth:`SamplingParams.validate` runs every check vLLM makes on
these fields (with the field checks of :mod:`.validation`, shared with
:class:`~.requests.EngineCoreRequest`), before anything is sent. :func:`fill_eos` is the one
EOS fill, with its one precedence. A ``SamplingParams`` holds no state besides its fields:
what is remembered for a shared instance (a successful validation, the wire map, the EOS
copy; batch jobs reuse one instance for many requests) is in this module's small identity
memos (:func:`remember`), never on the instance. The token id converters the request
types share are here too.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any, Final

import attrs
import numpy as np

from ..errors import InvalidRequestError
from .structured_outputs import StructuredOutputsParams, memoizable
from .validation import (
    DEFAULT_MAX_TOKENS,
    INT64_MIN,
    UINT64_MAX,
    check_extra_args,
    check_float,
    check_int,
    check_logprobs,
    check_token,
    safe_repr,
)

__all__ = ["DEFAULT_MAX_TOKENS", "MEMO_SIZE", "OUTPUT_KIND_DELTA", "SamplingParams",
           "fill_eos", "remember"]

#: ``RequestOutputKind.DELTA``: the engine always sends deltas; vLLM's front end says so.
OUTPUT_KIND_DELTA: Final = 1

#: How many instances each memo below remembers.
MEMO_SIZE: Final = 8


def remember(memo: dict[int, tuple[Any, ...]], entry: tuple[Any, ...]) -> None:
    """Put ``entry`` (its first item the object it is about) in an identity memo: a dict
    keyed by ``id(obj)``, read inline as ``memo.get(id(obj))`` then ``entry[0] is obj``.

    By identity, not equality: a frozen value may hold a mapping, and hashing one per
    request costs more than the work saved. The object is held while it is remembered, so
    its ``id`` is not reused meanwhile; the oldest entry goes past :data:`MEMO_SIZE`.
    """
    key = id(entry[0])
    if key not in memo and len(memo) >= MEMO_SIZE:
        try:
            del memo[next(iter(memo))]
        except (KeyError, RuntimeError, StopIteration):  # another thread got there first
            pass
    memo[key] = entry


def _memoizable(params: SamplingParams) -> bool:
    """Whether what is worked out for ``params`` stays true: not with a mutable mapping set
    (``logit_bias``, ``extra_args``, a ``structured_outputs.json`` schema), whose contents
    could change."""
    return params.logit_bias is None and params.extra_args is None and memoizable(
        params.structured_outputs)


# The identity memos (remember()) of this module. A SamplingParams holds no state besides
# its fields: what is worked out for a shared instance (batch jobs reuse one for many
# requests) is remembered here.
#: (params, (vocab_size, max_logprobs)) of the last successful validations.
_VALIDATED: dict[int, tuple[Any, ...]] = {}
#: (params, max_tokens, wire map) of the last wire maps.
_WIRE: dict[int, tuple[Any, ...]] = {}
#: (params, eos_token_id, other_eos_ids, filled copy) of the last EOS fills.
_EOS: dict[int, tuple[Any, ...]] = {}


def _sequence(value: Any, field: str) -> tuple[Any, ...]:
    if type(value) is tuple:
        return value
    if type(value) is list:
        return tuple(value)
    if isinstance(value, str | bytes | Mapping):
        raise InvalidRequestError(field, f"must be a sequence of token ids, got "
                                  f"{type(value).__name__}")
    try:
        return tuple(value)
    except TypeError:
        raise InvalidRequestError(field, f"must be a sequence of token ids, got "
                                  f"{type(value).__name__}") from None


def token_ids(value: Iterable[int], field: str = "prompt_token_ids") -> tuple[int, ...]:
    """Convert token ids once: a tuple as is, a 1-d numpy array through ``tolist()`` (its
    elements become Python ints in one C loop), any other iterable through ``tuple()``.

    Element types and ranges are checked by ``validate``, not here.
    """
    if type(value) is list:
        return tuple(value)
    if type(value) is tuple:
        return value
    if isinstance(value, np.ndarray) and value.ndim == 1:
        return tuple(value.tolist())
    return _sequence(value, field)


def int_tuple(value: Iterable[int]) -> tuple[int, ...]:
    """attrs converter for ``stop_token_ids`` (typed, unlike ``converter=tuple``)."""
    return token_ids(value, "stop_token_ids")


def _token_list(value: Iterable[int] | None) -> tuple[int, ...] | None:
    return None if value is None else token_ids(value, "allowed_token_ids")


def _token_sequences(value: Iterable[Iterable[int]]) -> tuple[tuple[int, ...], ...]:
    sequences = _sequence(value, "stop_token_sequences")
    if not sequences:
        return ()
    return tuple(token_ids(v, f"stop_token_sequences[{i}]") for i, v in enumerate(sequences))


def _token_lists(value: Iterable[Iterable[int]] | None) -> tuple[tuple[int, ...], ...] | None:
    if value is None:
        return None
    return tuple(token_ids(v, f"bad_words_token_ids[{i}]")
                 for i, v in enumerate(_sequence(value, "bad_words_token_ids")))


@attrs.frozen(kw_only=True)
class SamplingParams:
    """Sampling parameters for one request (token ids only: no stop strings, no detokenizer).

    ``max_tokens=None`` means "up to the model's context length"; the client fills it in
    from the engine's ``max_model_len`` as vLLM's front end does. ``eos_token_id`` is the
    model's end-of-sequence token: set it (or let the client fill it in from its config) so
    the engine stops on EOS, unless ``ignore_eos`` is true. ``stop_token_sequences`` are
    multi-token stop conditions matched by the client across engine steps.

    Construction only converts; :meth:`validate` (run by the engine client before anything
    is sent) checks every field against vLLM's rules.

    Raises:
        InvalidRequestError: a token-id field (``stop_token_ids``, ``allowed_token_ids``,
            ``stop_token_sequences``, ...) is not a sequence of ints.
    """

    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=int_tuple)
    stop_token_sequences: tuple[tuple[int, ...], ...] = attrs.field(
        default=(), converter=_token_sequences
    )
    ignore_eos: bool = False
    max_tokens: int | None = None
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    eos_token_id: int | None = None
    bad_words_token_ids: tuple[tuple[int, ...], ...] | None = attrs.field(
        default=None, converter=_token_lists
    )
    logit_bias: Mapping[int, float] | None = None
    allowed_token_ids: tuple[int, ...] | None = attrs.field(default=None, converter=_token_list)
    skip_reading_prefix_cache: bool | None = None
    extra_args: Mapping[str, Any] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    def with_eos_token_id(self, eos_token_id: int) -> SamplingParams:
        """A copy with ``eos_token_id`` set (:func:`fill_eos` with it and no other EOS ids:
        the parameters' own ``eos_token_id`` is replaced). The copy made last for an
        instance and a value is reused, so a shared instance's copy keeps its memos warm."""
        memo = _EOS.get(id(self))
        if memo is not None and memo[0] is self and memo[2] is None and (
                memo[1] is eos_token_id or (type(eos_token_id) is int
                                            and memo[1] == eos_token_id)):
            copy: SamplingParams = memo[3]
            return copy
        copy = _filled(self, eos_token_id, ())
        remember(_EOS, (self, eos_token_id, None, copy))  # None: not fill_eos's entry
        return copy

    def validate(self, *, vocab_size: int | None = None, max_logprobs: int | None = None) -> None:
        """Raise :class:`InvalidRequestError` for anything vLLM would reject or die on.

        ``vocab_size`` bounds every token id; ``max_logprobs`` is the engine's limit on
        ``logprobs`` and ``prompt_logprobs`` (``-1``: the vocabulary size, as in vLLM). A
        successful check is remembered per ``(vocab_size, max_logprobs)``.
        """
        key = (vocab_size, max_logprobs)
        memo = _VALIDATED.get(id(self))
        if memo is not None and memo[0] is self and memo[1] == key:
            return
        self._validate(vocab_size, max_logprobs)
        if _memoizable(self):
            remember(_VALIDATED, (self, key))

    def _validate(self, vocab_size: int | None, max_logprobs: int | None) -> None:
        check_int(self.n, "n", low=1)
        if self.n != 1:
            raise InvalidRequestError("n", f"must be 1 (the engine samples one sequence per "
                                      f"request; fan out on the client), got {self.n}")
        check_float(self.presence_penalty, "presence_penalty", -2.0, 2.0)
        check_float(self.frequency_penalty, "frequency_penalty", -2.0, 2.0)
        check_float(self.repetition_penalty, "repetition_penalty", 0.0, math.inf)
        if not math.isfinite(self.repetition_penalty):
            raise InvalidRequestError(
                "repetition_penalty", f"must be a finite number, got {self.repetition_penalty}"
            )
        if self.repetition_penalty <= 0.0:
            raise InvalidRequestError(
                "repetition_penalty", f"must be greater than zero, got {self.repetition_penalty}"
            )
        check_float(self.temperature, "temperature", 0.0, 2.0)
        check_float(self.top_p, "top_p", 0.0, 1.0)
        if self.top_p <= 0.0:
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p}")
        check_int(self.top_k, "top_k", low=-1)
        check_float(self.min_p, "min_p", 0.0, 1.0)
        if self.seed is not None:
            check_int(self.seed, "seed", low=INT64_MIN, high=UINT64_MAX)
        if self.max_tokens is not None:
            check_int(self.max_tokens, "max_tokens", low=1)
        check_int(self.min_tokens, "min_tokens", low=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                "min_tokens",
                f"must be at most max_tokens={self.max_tokens}, got {self.min_tokens}",
            )
        if self.logprobs is not None:
            check_logprobs(self.logprobs, "logprobs", vocab_size, max_logprobs)
        if self.prompt_logprobs is not None:
            check_logprobs(self.prompt_logprobs, "prompt_logprobs", vocab_size, max_logprobs)
        if type(self.ignore_eos) is not bool:
            raise InvalidRequestError("ignore_eos", "must be a bool")
        if self.eos_token_id is not None:
            check_token(self.eos_token_id, "eos_token_id", vocab_size)
        for i, token in enumerate(self.stop_token_ids):
            check_token(token, f"stop_token_ids[{i}]", vocab_size)
        for i, seq in enumerate(self.stop_token_sequences):
            if not seq:
                raise InvalidRequestError(f"stop_token_sequences[{i}]", "must not be empty")
            for j, token in enumerate(seq):
                check_token(token, f"stop_token_sequences[{i}][{j}]", vocab_size)
        if self.bad_words_token_ids is not None:
            for i, seq in enumerate(self.bad_words_token_ids):
                if not seq:
                    raise InvalidRequestError(f"bad_words_token_ids[{i}]", "must not be empty")
                for j, token in enumerate(seq):
                    check_token(token, f"bad_words_token_ids[{i}][{j}]", vocab_size)
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise InvalidRequestError("allowed_token_ids", "must not be empty")
            for i, token in enumerate(self.allowed_token_ids):
                check_token(token, f"allowed_token_ids[{i}]", vocab_size)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, Mapping):
                raise InvalidRequestError("logit_bias", "must be a mapping of token id to bias")
            for token, bias in self.logit_bias.items():
                # A key's repr could be the decimal text of a huge int: Python refuses it.
                key = safe_repr(token)
                check_token(token, f"logit_bias[{key}]", vocab_size)
                check_float(bias, f"logit_bias[{key}]", -math.inf, math.inf)
        if self.skip_reading_prefix_cache is not None and type(
            self.skip_reading_prefix_cache
        ) is not bool:
            raise InvalidRequestError("skip_reading_prefix_cache", "must be a bool or None")
        if self.extra_args is not None:
            check_extra_args(self.extra_args)
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise InvalidRequestError("structured_outputs", "must be a "
                                          "StructuredOutputsParams or None")
            self.structured_outputs.validate()

    def wire_for_request(self, max_tokens: int | None) -> dict[str, Any]:
        """:meth:`to_wire`, memoised per ``max_tokens``; the result must not be mutated."""
        memo = _WIRE.get(id(self))
        if memo is not None and memo[0] is self and memo[1] == max_tokens:
            wire: dict[str, Any] = memo[2]
            return wire
        wire = self.to_wire(max_tokens=max_tokens)
        if _memoizable(self):
            remember(_WIRE, (self, max_tokens, wire))
        return wire

    def to_wire(self, *, max_tokens: int | None = None) -> dict[str, Any]:
        """The msgpack map vLLM's engine decodes, defaults omitted (``omit_defaults``).

        ``max_tokens`` overrides the field (the client passes the resolved value). Mirrors
        what vLLM's ``SamplingParams.__post_init__`` produces: empty ``stop``/``bad_words``
        lists, de-duplicated ``stop_token_ids``, greedy sampling resetting top-p/top-k/min-p,
        and ``_all_stop_token_ids`` holding the stop tokens and EOS.
        """
        wire: dict[str, Any] = {}
        greedy = self.temperature < 1e-5
        if self.presence_penalty != 0.0:
            wire["presence_penalty"] = float(self.presence_penalty)
        if self.frequency_penalty != 0.0:
            wire["frequency_penalty"] = float(self.frequency_penalty)
        if self.repetition_penalty != 1.0:
            wire["repetition_penalty"] = float(self.repetition_penalty)
        if self.temperature != 1.0:
            wire["temperature"] = float(self.temperature)
        if not greedy:
            if self.top_p != 1.0:
                wire["top_p"] = float(self.top_p)
            if self.top_k != 0:
                wire["top_k"] = self.top_k
            if self.min_p != 0.0:
                wire["min_p"] = float(self.min_p)
        if self.seed is not None and self.seed != -1:
            wire["seed"] = self.seed
        wire["stop"] = []
        stop_ids = list(dict.fromkeys(self.stop_token_ids))
        wire["stop_token_ids"] = stop_ids
        if self.ignore_eos:
            wire["ignore_eos"] = True
        tokens = self.max_tokens if max_tokens is None else max_tokens
        if tokens is not None and tokens != DEFAULT_MAX_TOKENS:
            wire["max_tokens"] = tokens
        if self.min_tokens:
            wire["min_tokens"] = self.min_tokens
        if self.logprobs is not None:
            wire["logprobs"] = self.logprobs
        if self.prompt_logprobs is not None:
            wire["prompt_logprobs"] = self.prompt_logprobs
        wire["output_kind"] = OUTPUT_KIND_DELTA
        all_stop = dict.fromkeys(stop_ids)
        if self.eos_token_id is not None:
            # As vLLM: EOS stops the request unless ignore_eos, and min_tokens holds it back
            # either way.
            if not self.ignore_eos:
                wire["_eos_token_id"] = self.eos_token_id
            all_stop[self.eos_token_id] = None
        if all_stop:
            wire["_all_stop_token_ids"] = list(all_stop)
        if self.structured_outputs is not None:
            wire["structured_outputs"] = self.structured_outputs.to_wire()
        if self.logit_bias:
            wire["logit_bias"] = {int(k): float(v) for k, v in self.logit_bias.items()}
        if self.allowed_token_ids is not None:
            wire["allowed_token_ids"] = list(self.allowed_token_ids)
        if self.extra_args:
            wire["extra_args"] = dict(self.extra_args)
        wire["bad_words"] = []
        if self.bad_words_token_ids:
            wire["_bad_words_token_ids"] = [list(s) for s in self.bad_words_token_ids]
        skip = self.skip_reading_prefix_cache
        wire["skip_reading_prefix_cache"] = (
            self.prompt_logprobs is not None if skip is None else skip
        )
        return wire

    @classmethod
    def from_wire(cls, wire: Mapping[str, Any]) -> SamplingParams:
        """Rebuild from a wire map (engine side; unknown keys ignored as vLLM does)."""
        bad = wire.get("_bad_words_token_ids")
        structured = wire.get("structured_outputs")
        eos = wire.get("_eos_token_id")
        if eos is None and wire.get("ignore_eos"):
            # An ignored EOS travels only in _all_stop_token_ids (min_tokens holds it back).
            extra = [t for t in wire.get("_all_stop_token_ids") or ()
                     if t not in (wire.get("stop_token_ids") or ())]
            eos = extra[0] if len(extra) == 1 else None
        return cls(
            n=wire.get("n", 1),
            presence_penalty=wire.get("presence_penalty", 0.0),
            frequency_penalty=wire.get("frequency_penalty", 0.0),
            repetition_penalty=wire.get("repetition_penalty", 1.0),
            temperature=wire.get("temperature", 1.0),
            top_p=wire.get("top_p", 1.0),
            top_k=wire.get("top_k", 0),
            min_p=wire.get("min_p", 0.0),
            seed=wire.get("seed"),
            stop_token_ids=wire.get("stop_token_ids") or (),
            ignore_eos=wire.get("ignore_eos", False),
            max_tokens=wire.get("max_tokens", DEFAULT_MAX_TOKENS),
            min_tokens=wire.get("min_tokens", 0),
            logprobs=wire.get("logprobs"),
            prompt_logprobs=wire.get("prompt_logprobs"),
            eos_token_id=eos,
            bad_words_token_ids=bad,
            logit_bias=wire.get("logit_bias"),
            allowed_token_ids=wire.get("allowed_token_ids"),
            skip_reading_prefix_cache=wire.get("skip_reading_prefix_cache"),
            extra_args=wire.get("extra_args"),
            structured_outputs=None if structured is None
            else StructuredOutputsParams.from_wire(structured),
        )

    @property
    def all_stop_token_ids(self) -> frozenset[int]:
        """Stop tokens plus EOS (even if ignored): the tokens ``min_tokens`` holds back."""
        ids = set(self.stop_token_ids)
        if self.eos_token_id is not None:
            ids.add(self.eos_token_id)
        return frozenset(ids)


def fill_eos(params: SamplingParams, eos_token_id: int | None,
             other_eos_ids: tuple[int, ...] = ()) -> SamplingParams:
    """``params`` with the model's end-of-sequence tokens: the one EOS fill, as vLLM's
    ``SamplingParams.update_from_generation_config`` does it.

    The precedence, the only one: the parameters' own ``eos_token_id`` wins; else
    ``eos_token_id`` (the model's primary EOS: a :class:`~anyio_genout.TextClient`'s
    tokenizer's, else ``ClientConfig.eos_token_id``) is filled in. ``other_eos_ids`` (the
    model folder's other EOS ids) are appended to ``stop_token_ids`` unless ``ignore_eos``
    (with it, the primary EOS only holds back under ``min_tokens``, as in vLLM). Nothing to
    fill: ``params`` itself. The result for the last few instances and ids is remembered,
    so a shared instance gets one copy (whose memos then serve every request). Anything
    but a :class:`SamplingParams` (or one whose ``ignore_eos`` is not a bool) is returned
    as it is, for validation to refuse.
    """
    memo = _EOS.get(id(params))
    if (memo is not None and memo[0] is params and memo[1] is eos_token_id
            and memo[2] is other_eos_ids):
        filled: SamplingParams = memo[3]
        return filled
    if not isinstance(params, SamplingParams) or not _is_bool(params.ignore_eos):
        return params
    eos = None if params.eos_token_id is not None else eos_token_id
    others = () if params.ignore_eos else tuple(
        t for t in other_eos_ids if t not in params.stop_token_ids)
    filled = params if eos is None and not others else _filled(params, eos, others)
    remember(_EOS, (params, eos_token_id, other_eos_ids, filled))
    return filled


def _is_bool(value: object) -> bool:
    return type(value) is bool


def _filled(params: SamplingParams, eos_token_id: int | None,
            other_eos_ids: tuple[int, ...]) -> SamplingParams:
    changes: dict[str, Any] = {}
    if eos_token_id is not None:
        changes["eos_token_id"] = eos_token_id
    if other_eos_ids:
        changes["stop_token_ids"] = (*params.stop_token_ids, *other_eos_ids)
    return attrs.evolve(params, **changes)
