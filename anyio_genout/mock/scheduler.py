"""The mock engine's scheduler: the waiting queue, the running batch and their accounting.

:class:`Scheduler` is the part of :class:`~.engine.MockEngine` that holds every live request
(a :class:`~.request.Request`); it sends through the engine's :class:`~.wire.OutputWriter`
(which it is given, and uses by its public methods only). It does what vLLM's scheduler
does around a step: add requests to the waiting queue (or
fail them: a request-scoped ERROR output, or ``ENGINE_CORE_DEAD`` on a duplicate id), admit
them FIFO into the running batch up to ``max_num_seqs``, preempt, abort (silently and
idempotently, removing aborted requests in batches), pause, and keep the KV-cache token
count and an LRU prefix cache of block hashes for the prefix-cache stats.

The step (:class:`~.step.Stepper`) reads ``running`` and ``zombies`` directly in its hot
loop, and hands what it did back through :meth:`Scheduler.account`; everything else the
other parts need is a method here.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from collections.abc import Iterable
from typing import Any, Final

from ..protocol import AddRequest, EngineCoreEventType, EngineCoreFinishReason
from .config import MockEngineConfig
from .prefix_cache import PrefixCache
from .request import Request, set_plain
from .tokens import GREEDY_TEMPERATURE, greedy_continuation, stream_key
from .wire import OutputWriter, pack

__all__ = ["STRUCTURED_OUTPUTS_UNSUPPORTED", "Pause", "Scheduler"]

#: Why the mock refuses a request with a ``structured_outputs`` constraint.
STRUCTURED_OUTPUTS_UNSUPPORTED: Final = (
    "structured outputs are not supported by the mock engine (it has no grammar backend)")

_ABORT: Final = int(EngineCoreFinishReason.ABORT)
_ERROR: Final = int(EngineCoreFinishReason.ERROR)
_QUEUED: Final = int(EngineCoreEventType.QUEUED)
_SCHEDULED: Final = int(EngineCoreEventType.SCHEDULED)
_PREEMPTED: Final = int(EngineCoreEventType.PREEMPTED)


class Pause(enum.IntEnum):
    UNPAUSED = 0
    NEW = 1  # new requests queue, running ones keep stepping
    ALL = 2  # nothing steps


class Scheduler:
    """Requests and the batch (the scheduling part of :class:`~.engine.MockEngine`).

    Public state: ``running`` (the batch, in order; may hold aborted requests until
    :meth:`purge`), ``waiting`` (FIFO), ``zombies`` (aborted, still owed late outputs),
    ``dirty`` (aborted requests still sit in ``running`` or ``waiting``), ``pause``,
    ``owes_stats`` (an empty step owes the stats, after a finish or an abort), and the
    history: ``added_ids``, ``aborted_ids``, ``abort_frames``.
    """

    def __init__(self, config: MockEngineConfig, writer: OutputWriter) -> None:
        self.config = config
        self.added_ids: list[str] = []
        self.aborted_ids: list[str] = []
        self.abort_frames = 0
        self.running: list[Request] = []
        self.waiting: deque[Request] = deque()
        self.zombies: list[Request] = []
        self.dirty = False
        self.pause = Pause.UNPAUSED
        self.owes_stats = False
        self._writer = writer
        self._requests: dict[str, Request] = {}
        self._kv_tokens = 0
        self._prefix_cache = PrefixCache(config.block_size, config.prefix_cache_size)
        #: Prompt tokens computed (not found cached) by admissions since the last
        #: :meth:`take_prefill_time` (what ``prefill_time_per_token`` charges for).
        self.computed_prompt_tokens = 0

    # ------------------------------------------------------------------ requests

    def add(self, add: AddRequest) -> None:
        cfg = self.config
        req = add.request
        rid = req.request_id
        if rid in self._requests:
            self._writer.die(f"AssertionError: duplicate request id {rid!r}")
            return
        if cfg.keep_history:
            self.added_ids.append(rid)
        if not 0 <= req.client_index < self._writer.num_clients:
            self._writer.errors.append(f"request {rid!r}: client_index {req.client_index} has no "
                               f"output socket; dropped")
            return
        if req.max_tokens is None:
            # Request.from_engine_core_request asserts max_tokens is set; vLLM turns the
            # preprocessing failure into a request-scoped ERROR output.
            self._writer.errors.append(f"request {rid!r}: max_tokens is nil")
            self._writer.send_finish_outputs(req.client_index, [(rid, None)], _ERROR)
            return
        if add.sampling_wire.get("structured_outputs") is not None:
            # No grammar backend: the request is refused as a real engine refuses one it
            # cannot prepare (request-scoped ERROR, no tokens; 0.33 says why).
            self._writer.errors.append(f"request {rid!r}: {STRUCTURED_OUTPUTS_UNSUPPORTED}")
            self._writer.send_finish_outputs(
                req.client_index, [(rid, None)], _ERROR,
                error={"code": "validation_error", "message": STRUCTURED_OUTPUTS_UNSUPPORTED,
                       "retryable": False})
            return
        r = self._new_request(add)
        self._requests[rid] = r
        self.waiting.append(r)
        if cfg.log_stats:
            r.events = [(_QUEUED, time.monotonic())]

    def _new_request(self, add: AddRequest) -> Request:
        cfg = self.config
        req = add.request
        wire = add.sampling_wire
        params = req.sampling_params
        prompt = list(req.prompt_token_ids)
        greedy = params.temperature < GREEDY_TEMPERATURE
        seed = params.seed if params.seed != -1 else None
        key = stream_key(prompt, greedy=greedy, seed=seed, engine_seed=cfg.seed,
                         request_id=req.request_id)
        stops = frozenset(params.stop_token_ids)
        eos = wire.get("_eos_token_id")
        all_stop = frozenset(wire.get("_all_stop_token_ids") or ()) | stops
        offset = 0
        bad_words = tuple(params.bad_words_token_ids or ())
        # A continuation's earlier outputs are its prompt here, which bad words do not see.
        if greedy and cfg.greedy_continuations and not bad_words:
            found = greedy_continuation(
                prompt, cfg.greedy_continuations, cfg.vocab_size, min_tokens=params.min_tokens,
                avoid=all_stop if params.min_tokens else (),
                allowed=list(params.allowed_token_ids) if params.allowed_token_ids else None,
                eos_token_id=cfg.eos_token_id, eos_probability=cfg.eos_probability,
                corpus=cfg.corpus_token_ids, starts=cfg.corpus_starts)
            if found is not None:
                key, offset = found
        checks = stops | {eos} if eos is not None else stops
        vocab = cfg.vocab_size
        oov = any(t < 0 or t >= vocab for t in prompt) or any(
            t < 0 or t >= vocab for t in all_stop)
        assert req.max_tokens is not None
        limit = min(req.max_tokens, cfg.max_model_len - len(prompt))
        logprobs = params.logprobs
        if logprobs is not None and logprobs < 0:
            logprobs = vocab
        prompt_logprobs = params.prompt_logprobs
        if prompt_logprobs is not None and prompt_logprobs < 0:
            prompt_logprobs = vocab
        trace = dict(req.trace_headers) if req.trace_headers else None
        mid = (b"\xc0" * 8 + (b"\xc0" if trace is None else pack(trace))
               + b"\xc0\xc0\x00" + self._writer.tail_fields)
        return Request(
            rid=req.request_id, client=req.client_index, prompt=prompt, key=key,
            greedy=greedy, limit=limit, eos=eos, stops=stops, checks=checks,
            all_stop=all_stop, min_tokens=params.min_tokens, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            allowed=list(params.allowed_token_ids) if params.allowed_token_ids else None,
            trace=trace, cache_salt=req.cache_salt, oov=oov,
            prefix=self._writer.row_header + pack(req.request_id), mid=mid, offset=offset,
            bad_words=bad_words,
        )

    def abort(self, ids: Iterable[str]) -> None:
        ids = list(ids)
        self.abort_frames += 1
        if self.config.keep_history:
            self.aborted_ids.extend(ids)
        late = self.config.faults.late_outputs_after_abort
        for rid in ids:
            r = self._requests.pop(rid, None)
            if r is None:
                continue  # unknown or finished: ignored
            r.alive = False
            self.dirty = True
            if late and r.scheduled_once and r in self.running:
                r.late = late
                self.zombies.append(r)
        if self.config.log_stats:
            self.owes_stats = True

    def purge(self) -> None:
        """Drop aborted requests from the queues (batched: aborts can come by the thousand)."""
        self.dirty = False
        running = [r for r in self.running if r.alive]
        for r in self.running:
            if not r.alive:
                self._kv_tokens -= len(r.prompt) + r.num_out
        self.running = running
        self.waiting = deque(r for r in self.waiting if r.alive)

    def abort_everything(self, *, shutdown: bool) -> None:
        """Finish every request with ABORT outputs (pause mode "abort", or SIGTERM)."""
        by_client: dict[int, list[tuple[str, dict[str, str] | None]]] = {}
        for r in [*self.running, *self.waiting]:
            if r.alive:
                r.alive = False
                self._requests.pop(r.rid, None)
                by_client.setdefault(r.client, []).append((r.rid, r.trace))
        self.running = []
        self.waiting = deque()
        self.zombies = []
        self._kv_tokens = 0
        for client, requests in by_client.items():
            self._writer.send_finish_outputs(client, requests, _ABORT, tracked=shutdown)

    # ------------------------------------------------------------------ scheduling

    def has_step_work(self) -> bool:
        if self.pause is Pause.ALL:
            return False
        if self.zombies:
            return True
        return bool(self.running or (self.waiting and self.pause is Pause.UNPAUSED))

    def admit(self, now: float) -> None:
        """Move waiting requests into the running batch (FIFO, up to max_num_seqs)."""
        cfg = self.config
        waiting = self.waiting
        running = self.running
        while waiting and len(running) < cfg.max_num_seqs:
            r = waiting.popleft()
            if not r.alive:
                continue
            if r.oov:
                # The worker indexes the embedding table with it and dies.
                self._writer.die(f"request {r.rid!r}: token id out of vocabulary "
                          f"(vocab_size={cfg.vocab_size}): IndexError: index out of range "
                          f"in self")
                return
            if cfg.log_stats:
                if r.events is None:
                    r.events = []
                r.events.append((_SCHEDULED, now))
            if not r.scheduled_once:
                r.scheduled_once = True
                r.prefill = self._prefill_stats(r)
                r.want_prompt_logprobs = r.prompt_logprobs is not None
            set_plain(r, False)
            running.append(r)
            self._kv_tokens += len(r.prompt) + r.num_out

    def _prefill_stats(self, r: Request) -> dict[str, int]:
        cfg = self.config
        n = len(r.prompt)
        cached = created = 0
        if cfg.enable_prefix_caching:
            # Prompt logprobs skip reading the cache.
            cached = self._prefix_cache.lookup_and_insert(r.prompt, r.cache_salt,
                                                          read=r.prompt_logprobs is None)
            created = max(0, n // cfg.block_size * cfg.block_size - cached)
        self.computed_prompt_tokens += n - cached
        return {
            "num_prompt_tokens": n, "num_computed_tokens": n - cached,
            "num_cached_tokens": cached, "num_local_cached_tokens": cached,
            "num_external_cached_tokens": 0, "num_cache_creation_tokens": created,
        }

    def preempt(self, r: Request, now: float) -> None:
        self.running.remove(r)
        self._kv_tokens -= len(r.prompt) + r.num_out
        r.num_preemptions += 1
        if self.config.log_stats:
            if r.events is None:
                r.events = []
            r.events.append((_PREEMPTED, now))
            set_plain(r, False)
        self.waiting.appendleft(r)

    def preempt_all(self, now: float) -> None:
        for r in reversed([r for r in self.running if r.alive]):
            self.preempt(r, now)

    def running_alive(self) -> bool:
        return any(r.alive for r in self.running)

    def reset_prefix_cache(self) -> None:
        self._prefix_cache.reset()

    def take_prefill_time(self) -> float:
        """Seconds the prompt tokens computed since the last call cost
        (``prefill_time_per_token`` each); 0 without that cost."""
        tokens, self.computed_prompt_tokens = self.computed_prompt_tokens, 0
        return tokens * self.config.prefill_time_per_token

    def preempt_last(self, now: float) -> None:
        """Preempt the newest running request (``preempt_every`` fault injection)."""
        if self.running:
            self.preempt(self.running[-1], now)

    # ------------------------------------------------------------------ after a step

    def account(self, emitted: int, finished: list[Request]) -> None:
        """Book a step: ``emitted`` tokens were generated, ``finished`` requests are done
        (already marked not alive by the step)."""
        self._kv_tokens += emitted
        if finished:
            requests = self._requests
            for r in finished:
                del requests[r.rid]
                self._kv_tokens -= len(r.prompt) + r.num_out
            self.running = [r for r in self.running if r.alive]
            if self.config.log_stats:
                self.owes_stats = True

    def settle_late(self) -> None:
        """Forget the zombies that were sent every late output they were owed."""
        self.zombies = [r for r in self.zombies if r.late > 0]

    def kv_cache_usage(self) -> float:
        cfg = self.config
        used_blocks = -(-max(self._kv_tokens, 0) // cfg.block_size)
        return float(min(1.0, used_blocks / cfg.gpu_blocks))

    def take_prefix_cache_stats(self) -> dict[str, Any] | None:
        """The prefix-cache stats since the last call (None with prefix caching off)."""
        if not self.config.enable_prefix_caching:
            return None
        return self._prefix_cache.take_stats()
