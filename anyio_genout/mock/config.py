"""Configuration of the mock engine core: what it pretends to be and how it misbehaves.

A :class:`MockEngineConfig` describes one engine (one data-parallel rank). It either dials a
front end's handshake socket like ``vllm serve --headless`` (``handshake_address``) or is told
its input and output addresses directly (``input_address`` + ``output_addresses``: the
"bootstrapped" mode, no handshake socket). :class:`MockFaults` holds the fault-injection knobs.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable
from typing import Any

import attrs

__all__ = ["BLOCK_SIZE", "MockEngineConfig", "MockFaults"]

#: KV-cache block size the mock reports and counts prefix-cache hits in.
BLOCK_SIZE = 16


def _non_negative(_inst: object, attribute: attrs.Attribute[Any], value: float | None) -> None:
    if value is not None and value < 0:
        raise ValueError(f"{attribute.name} must be non-negative, got {value}")


def _positive(_inst: object, attribute: attrs.Attribute[Any], value: int | None) -> None:
    if value is not None and value < 1:
        raise ValueError(f"{attribute.name} must be at least 1, got {value}")


@attrs.frozen(kw_only=True)
class MockFaults:
    """Fault injection. Step counts are engine steps that generated tokens.

    * ``ready_delay``: seconds between INIT (or start-up, bootstrapped) and registering,
      like a model that takes time to load.
    * ``dead_after_steps``: after that many steps, send ``ENGINE_CORE_DEAD`` on every output
      socket and stop (an engine-core crash).
    * ``silent_after_steps``: after that many steps, stop reading input and stop stepping, as
      a real engine whose input thread died while its process lives on.
    * ``garbage_after_steps``: after that many steps, send one undecodable message (``0xc1``,
      never valid msgpack) on every output socket, once.
    * ``late_outputs_after_abort``: after an ABORT arrives for a running request, still emit
      this many token outputs for it (a real engine may emit one step already in flight).
    * ``preempt_every``: every that many steps preempt the newest running request: it gets
      a PREEMPTED event (with log stats) and is requeued at the head of the waiting queue.
    * ``abort_on_shutdown``: when cancelled, finish every request with an ABORT output and
      ``finished_requests`` (like SIGTERM to a real EngineCore process) before closing.

    Raises :class:`ValueError` naming the field for a negative value, or a ``preempt_every``
    below 1.
    """

    ready_delay: float = attrs.field(default=0.0, validator=_non_negative)
    dead_after_steps: int | None = attrs.field(default=None, validator=_non_negative)
    silent_after_steps: int | None = attrs.field(default=None, validator=_non_negative)
    garbage_after_steps: int | None = attrs.field(default=None, validator=_non_negative)
    late_outputs_after_abort: int = attrs.field(default=0, validator=_non_negative)
    preempt_every: int | None = attrs.field(default=None, validator=_positive)
    abort_on_shutdown: bool = False


def _corpus(value: Iterable[int] | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    try:
        return tuple(operator.index(t) for t in value)
    except TypeError:
        raise ValueError("corpus_token_ids, corpus_starts and alternative_token_ids must be "
                         "sequences of integers") from None


def _addresses(value: str | Iterable[str]) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    return tuple(value)


@attrs.frozen(kw_only=True)
class MockEngineConfig:
    """One mock engine core.

    Model and scheduler:

    * ``max_num_seqs`` requests run at once; more wait in a FIFO queue.
    * ``step_time``: seconds per engine step (0 = as fast as possible, yielding to the event
      loop and reading input after every ``steps_per_checkpoint`` steps: 1, the default,
      suits an engine that shares its event loop with a client; a process of its own can
      take more steps per yield, since a yield and an input check cost about what a step
      costs; new requests and aborts then wait up to that many steps).
    * ``max_model_len``: prompt + output cap (finish LENGTH).
    * ``vocab_size``: generated token ids are below it; a prompt or stop token id outside
      ``[0, vocab_size)`` kills the engine (``ENGINE_CORE_DEAD``), as a real one dies.
    * ``eos_token_id``: the fake model's end-of-sequence token. When set, the model emits it
      with probability ``eos_probability`` per position (deterministically); a request stops
      on it only if its sampling map carries ``_eos_token_id`` (as in vLLM).
    * ``num_speculative_tokens`` > 0: each step emits 1 to 1+k tokens per request.
    * ``enable_prefix_caching``: report cached prompt prefixes in whole blocks of
      :data:`BLOCK_SIZE` tokens (``num_cached_tokens`` in prefill stats), from an LRU of
      ``prefix_cache_blocks`` block hashes (default: ``gpu_blocks``; see
      :mod:`.prefix_cache`).
    * ``prefill_time_per_token``: with ``step_time`` > 0, a step that admits requests
      lasts that many seconds longer per prompt token not found cached (0, the default:
      prefill is free), so prefix-cache hits shorten time to first token as on a GPU.
    * ``seed``: seeds unseeded random sampling (greedy and seeded requests ignore it).
    * ``greedy_continuations`` > 0: a greedy request whose prompt ends with up to that many
      tokens a greedy request on the rest of it would generate first continues that
      generation, as a real model does (what a front end that moves a request to another
      engine relies on; see :func:`~.tokens.greedy_continuation`); not for a request with
      ``bad_words_token_ids`` (the words see only its own outputs). Off (0) by default: the
      search costs a hash per candidate length for every greedy request.
    * ``corpus_token_ids``: corpus mode (see :mod:`.tokens`): generated tokens continue this
      token sequence (a text encoded with the tokenizer of the front end) from a place the
      request's stream key chooses, so a detokenizing front end shows readable text;
      ``corpus_starts``: the places it may choose (positions in the corpus, e.g. where its
      sentences begin; default: any).
    * ``alternative_token_ids``: the top tokens of logprobs are drawn from these distinct
      ids (e.g. those whose token strings are distinct and readable; default: the whole
      vocabulary), the sampled token always among them at its rank.

    Structured outputs: the mock has no grammar backend. A request with a
    ``structured_outputs`` constraint ends at once with finish reason ERROR and no tokens
    (with an ``error`` object under ``output_fields=19``), as a real engine ends a request it
    cannot prepare (one started with ``--skip-tokenizer-init``); the engine stays up.

    Wire: ``vllm_version`` (reported in the ready response), ``output_fields`` (18 = the
    0.32 ``EngineCoreOutput`` layout, 19 = 0.33), ``log_stats`` (scheduler stats on every
    step, events on first outputs and stats-only messages after finishes; False is
    ``--disable-log-stats``).

    ``keep_history``: record every decoded request in :attr:`MockEngine.received` (and the
    id lists); switch off for long benchmark runs.

    Serving: ``handshake_timeout`` bounds the wait for INIT after HELLO (a real engine waits
    5 minutes; ``math.inf`` waits for a front end as long as it takes).
    ``front_end_timeout`` (handshake mode) bounds the wait for a front end to be listening at
    ``handshake_address`` at all (a ZeroMQ connection to its handshake socket): a front end
    that is there answers HELLO with INIT at once, so an engine with nobody to dial gives up
    after it (5 s by default; ``math.inf``, or a value not below ``handshake_timeout``, turns
    it off: an engine that starts before its front end, as the ``mock-engine`` command's,
    waits as long as ``handshake_timeout``). With
    ``until_client_leaves``, :meth:`MockEngine.serve` returns (normally, with
    ``client_left`` set) once the front end's input socket goes away: its process closed it
    or died. ``python -m anyio_genout mock-engine`` uses it to serve clients one after another, a
    fresh engine for each. A real engine handshakes once per process and never notices its
    front end leaving.

    Raises :class:`ValueError` when built with neither mode's addresses or both, a negative
    value, a count or size below 1, a ``rank`` beyond 2 bytes, ``output_fields`` other than
    18 or 19, an ``eos_token_id`` not below ``vocab_size``, an ``eos_probability``
    outside [0, 1], ``corpus_token_ids`` that are empty or not all in ``[0, vocab_size)``,
    ``corpus_starts`` without a corpus, empty or outside it, or ``alternative_token_ids``
    that are empty, repeated or not all in ``[0, vocab_size)``.
    """

    rank: int = attrs.field(default=0, validator=_non_negative)
    handshake_address: str | None = None
    input_address: str | None = None
    output_addresses: tuple[str, ...] = attrs.field(default=(), converter=_addresses)
    max_num_seqs: int = attrs.field(default=256, validator=_positive)
    step_time: float = attrs.field(default=0.0, validator=_non_negative)
    steps_per_checkpoint: int = attrs.field(default=1, validator=_positive)
    max_model_len: int = attrs.field(default=4096, validator=_positive)
    vocab_size: int = attrs.field(default=32000, validator=_positive)
    eos_token_id: int | None = attrs.field(default=None, validator=_non_negative)
    eos_probability: float = attrs.field(default=1 / 256, validator=_non_negative)
    vllm_version: str = "0.32.0"
    output_fields: int = 18
    log_stats: bool = True
    num_speculative_tokens: int = attrs.field(default=0, validator=_non_negative)
    enable_prefix_caching: bool = True
    block_size: int = attrs.field(default=BLOCK_SIZE, validator=_positive)
    num_gpu_blocks: int | None = attrs.field(default=None, validator=_positive)
    prefix_cache_blocks: int | None = attrs.field(default=None, validator=_positive)
    prefill_time_per_token: float = attrs.field(default=0.0, validator=_non_negative)
    dtype: str = "bfloat16"
    seed: int = 0
    greedy_continuations: int = attrs.field(default=0, validator=_non_negative)
    corpus_token_ids: tuple[int, ...] | None = attrs.field(default=None, converter=_corpus,
                                                           repr=False)
    corpus_starts: tuple[int, ...] | None = attrs.field(default=None, converter=_corpus,
                                                        repr=False)
    alternative_token_ids: tuple[int, ...] | None = attrs.field(default=None,
                                                                converter=_corpus, repr=False)
    keep_history: bool = True
    handshake_timeout: float = attrs.field(default=300.0, validator=_non_negative)
    front_end_timeout: float = attrs.field(default=5.0, validator=_non_negative)
    until_client_leaves: bool = False
    linger: float = attrs.field(default=4.0, validator=_non_negative)
    faults: MockFaults = attrs.field(factory=MockFaults)

    def __attrs_post_init__(self) -> None:
        if self.handshake_address is None:
            if self.input_address is None or not self.output_addresses:
                raise ValueError(
                    "give handshake_address (dial mode) or input_address and "
                    "output_addresses (bootstrapped mode)"
                )
        elif self.input_address is not None or self.output_addresses:
            raise ValueError("handshake_address excludes input_address/output_addresses")
        if self.rank >= 2**16:
            raise ValueError(f"rank must fit in 2 bytes, got {self.rank}")
        if self.output_fields not in (18, 19):
            raise ValueError(f"output_fields must be 18 (vLLM 0.32) or 19 (0.33), "
                             f"got {self.output_fields}")
        if self.eos_token_id is not None and self.eos_token_id >= self.vocab_size:
            raise ValueError("eos_token_id must be below vocab_size")
        if not 0.0 <= self.eos_probability <= 1.0:
            raise ValueError("eos_probability must be in [0, 1]")
        corpus = self.corpus_token_ids
        if corpus is not None and (not corpus or min(corpus) < 0
                                   or max(corpus) >= self.vocab_size):
            raise ValueError("corpus_token_ids must be a non-empty sequence of token ids in "
                             f"[0, vocab_size={self.vocab_size})")
        starts = self.corpus_starts
        if starts is not None and (corpus is None or not starts or min(starts) < 0
                                   or max(starts) >= len(corpus)):
            raise ValueError("corpus_starts must be a non-empty sequence of positions in "
                             "corpus_token_ids")
        alternatives = self.alternative_token_ids
        if alternatives is not None and (
                not alternatives or len(set(alternatives)) != len(alternatives)
                or min(alternatives) < 0 or max(alternatives) >= self.vocab_size):
            raise ValueError("alternative_token_ids must be distinct token ids in "
                             f"[0, vocab_size={self.vocab_size}), at least one")

    @property
    def identity(self) -> bytes:
        """The engine's ZeroMQ identity: its rank as 2 bytes little-endian."""
        return self.rank.to_bytes(2, "little")

    @property
    def prefix_cache_size(self) -> int:
        """Blocks the prefix cache holds at most (``prefix_cache_blocks``, else
        :attr:`gpu_blocks`)."""
        if self.prefix_cache_blocks is not None:
            return self.prefix_cache_blocks
        return self.gpu_blocks

    @property
    def gpu_blocks(self) -> int:
        """KV-cache blocks reported (default: room for every sequence at full length)."""
        if self.num_gpu_blocks is not None:
            return self.num_gpu_blocks
        return -(-self.max_num_seqs * self.max_model_len // self.block_size)
