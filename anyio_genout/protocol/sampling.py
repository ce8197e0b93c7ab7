"""``SamplingParams``: what the engine samples with, validated as strictly as vLLM does.

On the wire this is a msgpack *map* keyed by vLLM's field names, default values omitted,
including the private keys ``_eos_token_id`` (without it the engine never stops on EOS),
``_all_stop_token_ids`` (stop tokens ``min_tokens`` must hold back) and
``_bad_words_token_ids``. A malformed request silently kills a real engine's input thread, so
every check vLLM's own front end makes runs here, before anything is sent, and failures raise
:class:`~anyio_genout.InvalidRequestError` naming the field.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

import attrs

from ..errors import InvalidRequestError

__all__ = ["DEFAULT_MAX_TOKENS", "OUTPUT_KIND_DELTA", "SamplingParams"]

#: vLLM's struct default for ``max_tokens`` (what the engine uses when the key is absent).
DEFAULT_MAX_TOKENS: Final = 16
#: ``RequestOutputKind.DELTA``: the engine always sends deltas; vLLM's front end says so.
OUTPUT_KIND_DELTA: Final = 1
_INT64_MIN: Final = -(2**63)
_UINT64_MAX: Final = 2**64 - 1


def int_tuple(value: Iterable[int]) -> tuple[int, ...]:
    """attrs converter for token id fields (typed, unlike ``converter=tuple``)."""
    return tuple(value)


def _token_list(value: Sequence[int] | None) -> tuple[int, ...] | None:
    return None if value is None else tuple(value)


def _token_sequences(value: Iterable[Iterable[int]]) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(v) for v in value)


def _token_lists(value: Sequence[Sequence[int]] | None) -> tuple[tuple[int, ...], ...] | None:
    return None if value is None else tuple(tuple(v) for v in value)


@attrs.frozen(kw_only=True)
class SamplingParams:
    """Sampling parameters for one request (token ids only: no stop strings, no detokenizer).

    ``max_tokens=None`` means "up to the model's context length"; the client fills it in
    from the engine's ``max_model_len`` as vLLM's front end does. ``eos_token_id`` is the
    model's end-of-sequence token: set it (or let the client fill it in from its config) so
    the engine stops on EOS, unless ``ignore_eos`` is true. ``stop_token_sequences`` are
    multi-token stop conditions matched by the client across engine steps.
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
    # Memo of the last successful validate() and of the wire map (the instance is frozen, so
    # both stay true; batch jobs reuse one SamplingParams for many requests). Not kept when a
    # mutable mapping (logit_bias, extra_args) is set, since its contents could change.
    _validated_for: tuple[int | None, int | None] | None = attrs.field(
        default=None, init=False, eq=False, repr=False)
    _wire_memo: tuple[int | None, dict[str, Any]] | None = attrs.field(
        default=None, init=False, eq=False, repr=False)

    def validate(self, *, vocab_size: int | None = None, max_logprobs: int | None = None) -> None:
        """Raise :class:`InvalidRequestError` for anything vLLM would reject or die on."""
        key = (vocab_size, max_logprobs)
        if self._validated_for == key:
            return
        self._validate(vocab_size, max_logprobs)
        if self.logit_bias is None and self.extra_args is None:
            object.__setattr__(self, "_validated_for", key)

    def _validate(self, vocab_size: int | None, max_logprobs: int | None) -> None:
        _check_int(self.n, "n", low=1)
        if self.n != 1:
            raise InvalidRequestError("n", f"must be 1 (the engine samples one sequence per "
                                      f"request; fan out on the client), got {self.n}")
        _check_float(self.presence_penalty, "presence_penalty", -2.0, 2.0)
        _check_float(self.frequency_penalty, "frequency_penalty", -2.0, 2.0)
        _check_float(self.repetition_penalty, "repetition_penalty", 0.0, math.inf)
        if not math.isfinite(self.repetition_penalty):
            raise InvalidRequestError(
                "repetition_penalty", f"must be a finite number, got {self.repetition_penalty}"
            )
        if self.repetition_penalty <= 0.0:
            raise InvalidRequestError(
                "repetition_penalty", f"must be greater than zero, got {self.repetition_penalty}"
            )
        _check_float(self.temperature, "temperature", 0.0, 2.0)
        _check_float(self.top_p, "top_p", 0.0, 1.0)
        if self.top_p <= 0.0:
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p}")
        _check_int(self.top_k, "top_k", low=-1)
        _check_float(self.min_p, "min_p", 0.0, 1.0)
        if self.seed is not None:
            _check_int(self.seed, "seed", low=_INT64_MIN, high=_UINT64_MAX)
        if self.max_tokens is not None:
            _check_int(self.max_tokens, "max_tokens", low=1)
        _check_int(self.min_tokens, "min_tokens", low=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                "min_tokens",
                f"must be at most max_tokens={self.max_tokens}, got {self.min_tokens}",
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is None:
                continue
            _check_int(value, name, low=-1)
            if max_logprobs is not None and value > max_logprobs:
                raise InvalidRequestError(
                    name, f"at most {max_logprobs} are allowed by the engine, got {value}"
                )
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError("ignore_eos", "must be a bool")
        if self.eos_token_id is not None:
            _check_token(self.eos_token_id, "eos_token_id", vocab_size)
        for i, token in enumerate(self.stop_token_ids):
            _check_token(token, f"stop_token_ids[{i}]", vocab_size)
        for i, seq in enumerate(self.stop_token_sequences):
            if not seq:
                raise InvalidRequestError(f"stop_token_sequences[{i}]", "must not be empty")
            for j, token in enumerate(seq):
                _check_token(token, f"stop_token_sequences[{i}][{j}]", vocab_size)
        if self.bad_words_token_ids is not None:
            for i, seq in enumerate(self.bad_words_token_ids):
                if not seq:
                    raise InvalidRequestError(f"bad_words_token_ids[{i}]", "must not be empty")
                for j, token in enumerate(seq):
                    _check_token(token, f"bad_words_token_ids[{i}][{j}]", vocab_size)
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise InvalidRequestError("allowed_token_ids", "must not be empty")
            for i, token in enumerate(self.allowed_token_ids):
                _check_token(token, f"allowed_token_ids[{i}]", vocab_size)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, Mapping):
                raise InvalidRequestError("logit_bias", "must be a mapping of token id to bias")
            for token, bias in self.logit_bias.items():
                _check_token(token, f"logit_bias[{token!r}]", vocab_size)
                _check_float(bias, f"logit_bias[{token!r}]", -math.inf, math.inf)
        if self.skip_reading_prefix_cache is not None and not isinstance(
            self.skip_reading_prefix_cache, bool
        ):
            raise InvalidRequestError("skip_reading_prefix_cache", "must be a bool or None")
        if self.extra_args is not None:
            if not isinstance(self.extra_args, Mapping) or not all(
                isinstance(k, str) for k in self.extra_args
            ):
                raise InvalidRequestError("extra_args", "must be a mapping with string keys")
            _check_plain(self.extra_args, "extra_args")

    def wire_for_request(self, max_tokens: int | None) -> dict[str, Any]:
        """:meth:`to_wire`, memoised per ``max_tokens``; the result must not be mutated."""
        memo = self._wire_memo
        if memo is not None and memo[0] == max_tokens:
            return memo[1]
        wire = self.to_wire(max_tokens=max_tokens)
        if self.logit_bias is None and self.extra_args is None:
            object.__setattr__(self, "_wire_memo", (max_tokens, wire))
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
        if self.eos_token_id is not None and not self.ignore_eos:
            wire["_eos_token_id"] = self.eos_token_id
            all_stop[self.eos_token_id] = None
        if all_stop:
            wire["_all_stop_token_ids"] = list(all_stop)
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
            eos_token_id=wire.get("_eos_token_id"),
            bad_words_token_ids=bad,
            logit_bias=wire.get("logit_bias"),
            allowed_token_ids=wire.get("allowed_token_ids"),
            skip_reading_prefix_cache=wire.get("skip_reading_prefix_cache"),
            extra_args=wire.get("extra_args"),
        )

    @property
    def all_stop_token_ids(self) -> frozenset[int]:
        """Stop tokens plus EOS (unless ignored): the tokens ``min_tokens`` holds back."""
        ids = set(self.stop_token_ids)
        if self.eos_token_id is not None and not self.ignore_eos:
            ids.add(self.eos_token_id)
        return frozenset(ids)


def _check_int(value: object, field: str, *, low: int | None = None,
               high: int | None = None) -> None:
    if type(value) is not int:
        raise InvalidRequestError(field, f"must be an integer, got {type(value).__name__}")
    if low is not None and value < low:
        raise InvalidRequestError(field, f"must be at least {low}, got {value}")
    if high is not None and value > high:
        raise InvalidRequestError(field, f"must be at most {high}, got {value}")


def _check_float(value: object, field: str, low: float, high: float) -> None:
    # Fast path (this runs per request): NaN fails the comparison, and so does an infinity
    # unless the range itself is unbounded on that side, exactly as the checks below.
    if (type(value) is float or type(value) is int) and low <= value <= high:
        return
    if type(value) not in (int, float):
        raise InvalidRequestError(field, f"must be a number, got {type(value).__name__}")
    assert isinstance(value, int | float)
    if math.isnan(value) or (math.isinf(value) and not (math.isinf(low) or math.isinf(high))):
        raise InvalidRequestError(field, f"must be a finite number, got {value}")
    if not low <= value <= high:
        raise InvalidRequestError(field, f"must be in [{low:g}, {high:g}], got {value}")


def _check_token(value: object, field: str, vocab_size: int | None) -> None:
    if type(value) is not int:
        raise InvalidRequestError(field, f"token ids must be integers, got {type(value).__name__}")
    if value < 0:
        raise InvalidRequestError(field, f"token id must be non-negative, got {value}")
    if vocab_size is not None and value >= vocab_size:
        raise InvalidRequestError(
            field, f"token id {value} is out of vocabulary (vocab_size={vocab_size})"
        )
    if value > 2**31 - 1:
        raise InvalidRequestError(field, f"token id {value} does not fit in int32")


def _check_plain(value: object, field: str, depth: int = 0) -> None:
    if depth > 32:
        raise InvalidRequestError(field, "nested too deeply")
    if value is None or isinstance(value, bool | str | float):
        return
    if isinstance(value, int):
        if not _INT64_MIN <= value <= _UINT64_MAX:
            raise InvalidRequestError(field, "integers must fit in 64 bits")
        return
    if isinstance(value, Mapping):
        for k, v in value.items():
            _check_plain(k, field, depth + 1)
            _check_plain(v, f"{field}[{k!r}]", depth + 1)
        return
    if isinstance(value, list | tuple):
        for i, v in enumerate(value):
            _check_plain(v, f"{field}[{i}]", depth + 1)
        return
    raise InvalidRequestError(field, f"cannot be sent to the engine: {type(value).__name__}")
