"""The mock engine's scheduler: the waiting queue, the running batch and their accounting.

:class:`Scheduler` is the layer of :class:`~.engine.MockEngine` above
:class:`~.wire.OutputWriter`. It holds every live request (a :class:`~.request.Request`)
and does what vLLM's scheduler does around a step: add requests to the waiting queue (or
fail them: a request-scoped ERROR output, or ``ENGINE_CORE_DEAD`` on a duplicate id), admit
them FIFO into the running batch up to ``max_num_seqs``, preempt, abort (silently and
idempotently, removing aborted requests in batches), pause, and keep the KV-cache token
count and an LRU prefix cache of block hashes for the prefix-cache stats.
"""

from __future__ import annotations

import enum
import time
from collections import OrderedDict, deque
from collections.abc import Iterable
from typing import Final

from ..protocol import AddRequest, EngineCoreEventType, EngineCoreFinishReason
from .config import MockEngineConfig
from .request import Request, set_plain
from .tokens import GREEDY_TEMPERATURE, stream_key
from .wire import OutputWriter, pack

__all__ = ["Pause", "Scheduler"]

_ABORT: Final = int(EngineCoreFinishReason.ABORT)
_ERROR: Final = int(EngineCoreFinishReason.ERROR)
_QUEUED: Final = int(EngineCoreEventType.QUEUED)
_SCHEDULED: Final = int(EngineCoreEventType.SCHEDULED)
_PREEMPTED: Final = int(EngineCoreEventType.PREEMPTED)


class Pause(enum.IntEnum):
    UNPAUSED = 0
    NEW = 1  # new requests queue, running ones keep stepping
    ALL = 2  # nothing steps


class Scheduler(OutputWriter):
    """Requests and the batch (the layer of :class:`~.engine.MockEngine` above the outputs)."""

    def __init__(self, config: MockEngineConfig) -> None:
        super().__init__(config)
        self.added_ids: list[str] = []
        self.aborted_ids: list[str] = []
        self.abort_frames = 0
        self._requests: dict[str, Request] = {}
        self._running: list[Request] = []
        self._waiting: deque[Request] = deque()
        self._zombies: list[Request] = []  # aborted, still owed late outputs
        self._dirty = False  # aborted requests still sit in _running/_waiting
        self._pause = Pause.UNPAUSED
        self._flush_stats = False  # an empty step owes the stats (after a finish or abort)
        self._kv_tokens = 0
        self._prefix_cache: OrderedDict[int, None] = OrderedDict()
        self._pc_reset = False
        self._pc_requests = self._pc_queries = self._pc_hits = 0

    # ------------------------------------------------------------------ requests

    def _add(self, add: AddRequest) -> None:
        cfg = self.config
        req = add.request
        rid = req.request_id
        if rid in self._requests:
            self._die(f"AssertionError: duplicate request id {rid!r}")
            return
        if cfg.keep_history:
            self.added_ids.append(rid)
        if not 0 <= req.client_index < len(self._outputs):
            self.errors.append(f"request {rid!r}: client_index {req.client_index} has no "
                               f"output socket; dropped")
            return
        if req.max_tokens is None:
            # Request.from_engine_core_request asserts max_tokens is set; vLLM turns the
            # preprocessing failure into a request-scoped ERROR output.
            self.errors.append(f"request {rid!r}: max_tokens is nil")
            self._send_finish_outputs(req.client_index, [(rid, None)], _ERROR)
            return
        r = self._new_request(add)
        self._requests[rid] = r
        self._waiting.append(r)
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
               + b"\xc0\xc0\x00" + self._tail_fields)
        return Request(
            rid=req.request_id, client=req.client_index, prompt=prompt, key=key,
            greedy=greedy, limit=limit, eos=eos, stops=stops, checks=checks,
            all_stop=all_stop, min_tokens=params.min_tokens, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            allowed=list(params.allowed_token_ids) if params.allowed_token_ids else None,
            trace=trace, cache_salt=req.cache_salt, oov=oov,
            prefix=self._row_header + pack(req.request_id), mid=mid,
        )

    def _abort(self, ids: Iterable[str]) -> None:
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
            self._dirty = True
            if late and r.scheduled_once and r in self._running:
                r.late = late
                self._zombies.append(r)
        if self.config.log_stats:
            self._flush_stats = True

    def _purge(self) -> None:
        """Drop aborted requests from the queues (batched: aborts can come by the thousand)."""
        self._dirty = False
        running = [r for r in self._running if r.alive]
        for r in self._running:
            if not r.alive:
                self._kv_tokens -= len(r.prompt) + r.num_out
        self._running = running
        self._waiting = deque(r for r in self._waiting if r.alive)

    def _abort_everything(self, *, shutdown: bool) -> None:
        """Finish every request with ABORT outputs (pause mode "abort", or SIGTERM)."""
        by_client: dict[int, list[tuple[str, dict[str, str] | None]]] = {}
        for r in [*self._running, *self._waiting]:
            if r.alive:
                r.alive = False
                self._requests.pop(r.rid, None)
                by_client.setdefault(r.client, []).append((r.rid, r.trace))
        self._running = []
        self._waiting = deque()
        self._zombies = []
        self._kv_tokens = 0
        for client, requests in by_client.items():
            self._send_finish_outputs(client, requests, _ABORT, tracked=shutdown)

    # ------------------------------------------------------------------ scheduling

    def _has_step_work(self) -> bool:
        if self._pause is Pause.ALL:
            return False
        if self._zombies:
            return True
        return bool(self._running or (self._waiting and self._pause is Pause.UNPAUSED))

    def _admit(self, now: float) -> None:
        """Move waiting requests into the running batch (FIFO, up to max_num_seqs)."""
        cfg = self.config
        waiting = self._waiting
        running = self._running
        while waiting and len(running) < cfg.max_num_seqs:
            r = waiting.popleft()
            if not r.alive:
                continue
            if r.oov:
                # The worker indexes the embedding table with it and dies.
                self._die(f"request {r.rid!r}: token id out of vocabulary "
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
            bs = cfg.block_size
            hashes = []
            h = hash(("salt", r.cache_salt))
            for i in range(n // bs):
                h = hash((h, tuple(r.prompt[i * bs:(i + 1) * bs])))
                hashes.append(h)
            cache = self._prefix_cache
            hits = 0
            if r.prompt_logprobs is None:  # prompt logprobs skip reading the cache
                for h in hashes[:(n - 1) // bs]:  # the last prompt token is always computed
                    if h not in cache:
                        break
                    hits += 1
            for h in hashes:
                cache[h] = None
                cache.move_to_end(h)
            while len(cache) > cfg.gpu_blocks:
                cache.popitem(last=False)
            cached = hits * bs
            created = max(0, len(hashes) * bs - cached)
            self._pc_requests += 1
            self._pc_queries += n
            self._pc_hits += cached
        return {
            "num_prompt_tokens": n, "num_computed_tokens": n - cached,
            "num_cached_tokens": cached, "num_local_cached_tokens": cached,
            "num_external_cached_tokens": 0, "num_cache_creation_tokens": created,
        }

    def _preempt(self, r: Request, now: float) -> None:
        self._running.remove(r)
        self._kv_tokens -= len(r.prompt) + r.num_out
        r.num_preemptions += 1
        if self.config.log_stats:
            if r.events is None:
                r.events = []
            r.events.append((_PREEMPTED, now))
            set_plain(r, False)
        self._waiting.appendleft(r)

    def _preempt_all(self, now: float) -> None:
        for r in reversed([r for r in self._running if r.alive]):
            self._preempt(r, now)

    def _running_alive(self) -> bool:
        return any(r.alive for r in self._running)

    def _reset_prefix_cache(self) -> None:
        self._prefix_cache.clear()
        self._pc_reset = True
