"""One step of the mock engine: a token for every running request, packed into output rows.

:class:`Stepper` is the layer of :class:`~.engine.MockEngine` above
:class:`~.scheduler.Scheduler`. A step admits waiting requests (or, injected, preempts
one), generates one token per running request (1 to 1+k with speculative decoding, plus the
outputs owed after an abort under ``late_outputs_after_abort``), retires finished requests,
and sends one ``EngineCoreOutputs`` per client, the scheduler stats on the first.

``_generate`` is the hot loop: a plain row is appended as three pre-packed parts (see
:mod:`.wire`); only rows with logprobs, events, prefill stats or a finish are packed whole,
by ``_row``. Tokens come from :mod:`.tokens`, ``_CHUNK`` at a time per request.
"""

from __future__ import annotations

import time
from typing import Any, Final

from ..protocol import SchedulerStats
from ..protocol.logprobs import encode_logprobs
from .config import MockEngineConfig
from .request import Request, check_stop, set_plain
from .scheduler import Pause, Scheduler
from .tokens import fake_logprobs, fake_prompt_logprobs, generate
from .wire import array_header, pack

__all__ = ["Stepper"]

#: Tokens generated per refill of a request's token buffer.
_CHUNK: Final = 256


class Stepper(Scheduler):
    """The step (the layer of :class:`~.engine.MockEngine` above the scheduler)."""

    def __init__(self, config: MockEngineConfig) -> None:
        super().__init__(config)
        self.steps = 0
        self.last_stats: SchedulerStats | None = None
        self._spec_drafts = self._spec_accepted = 0
        self._spec_accepted_pos: list[int] = [0] * config.num_speculative_tokens

    # ------------------------------------------------------------------ the step

    def _step(self) -> None:
        cfg = self.config
        now = time.monotonic()
        self.steps += 1
        self._flush_stats = False
        preempt_every = cfg.faults.preempt_every
        if preempt_every is not None and self.steps % preempt_every == 0 and self._running:
            self._preempt(self._running[-1], now)  # the scheduler admits nobody this step
        elif self._pause is Pause.UNPAUSED:
            self._admit(now)
            if self.dead:
                return
        # Per client: packed rows, three parts per row (row bytes may be split in three).
        rows: list[list[bytes]] = [[] for _ in self._outputs]
        aux: dict[int, list[bytes | memoryview]] = {}
        finished: list[Request] = []
        if cfg.num_speculative_tokens:
            emitted = self._generate_spec(rows, aux, finished, now)
        else:
            emitted = self._generate(rows, aux, finished, now)
        if self._zombies:
            self._generate_late(rows)
        self._kv_tokens += emitted
        if finished:
            for r in finished:
                del self._requests[r.rid]
                self._kv_tokens -= len(r.prompt) + r.num_out
            self._running = [r for r in self._running if r.alive]
            if cfg.log_stats:
                self._flush_stats = True
        stats = self._stats_bytes() if cfg.log_stats else b"\xc0"
        sent = False
        for client, parts in enumerate(rows):
            if parts:
                self._send_message(client, parts, stats, weight_version=True,
                                   aux=aux.get(client))
                stats = b"\xc0"  # vLLM attaches the stats to the first client's message
                sent = True
        if not sent and cfg.log_stats:
            self._send_message(0, [], stats, weight_version=True)

    def _generate(self, rows: list[list[bytes]], aux: dict[int, list[bytes | memoryview]],
                  finished: list[Request], now: float) -> int:
        """One token per running request: the hot loop."""
        tokb = self._tokb
        running = self._running
        for r in running:
            n = r.num_out
            if n < r.fast_end:
                tok = r.buf[n - r.buf_start]
                r.num_out = n + 1
                if tok not in r.checks:
                    rows[r.client].extend((r.prefix, tokb[tok], r.mid))
                    continue
            else:
                if n >= r.buf_end:
                    self._refill(r, 1)
                tok = r.buf[n - r.buf_start]
                r.num_out = n + 1
            finish, reason = check_stop(r, tok, n + 1)
            rows[r.client].extend((self._row(r, [tok], finish, reason, aux, now), b"", b""))
            if finish is not None:
                r.alive = False
                finished.append(r)
        return len(running)

    def _generate_spec(self, rows: list[list[bytes]], aux: dict[int, list[bytes | memoryview]],
                       finished: list[Request], now: float) -> int:
        """Speculative decoding: 1 to 1+k accepted tokens per request per step."""
        k = self.config.num_speculative_tokens
        tokb = self._tokb
        emitted = 0
        accepted_pos = self._spec_accepted_pos
        for r in self._running:
            n = r.num_out
            if n + k + 1 > r.buf_end:
                self._refill(r, k + 1)
            accept = ((r.key ^ (n * 0x9E3779B97F4A7C15)) * 0xBF58476D1CE4E5B9 >> 40) % (k + 1)
            self._spec_drafts += 1
            self._spec_accepted += accept
            for i in range(accept):
                accepted_pos[i] += 1
            toks: list[int] = []
            finish: int | None = None
            reason: int | None = None
            base = n - r.buf_start
            for tok in r.buf[base:base + accept + 1]:
                toks.append(tok)
                n += 1
                finish, reason = check_stop(r, tok, n)
                if finish is not None:
                    break
            r.num_out = n
            emitted += len(toks)
            if r.plain and finish is None:
                packed = array_header(len(toks)) + b"".join([tokb[t][1:] for t in toks])
                rows[r.client].extend((r.prefix, packed, r.mid))
                continue
            rows[r.client].extend((self._row(r, toks, finish, reason, aux, now), b"", b""))
            if finish is not None:
                r.alive = False
                finished.append(r)
        return emitted

    def _generate_late(self, rows: list[list[bytes]]) -> None:
        """Outputs owed for aborted requests (``late_outputs_after_abort``)."""
        tokb = self._tokb
        for r in self._zombies:
            if r.num_out >= r.buf_end:
                self._refill(r, 1)
            tok = r.buf[r.num_out - r.buf_start]
            r.num_out += 1
            r.late -= 1
            rows[r.client].extend((r.prefix, tokb[tok], r.mid))
        self._zombies = [r for r in self._zombies if r.late > 0]

    def _refill(self, r: Request, need: int) -> None:
        cfg = self.config
        start = r.num_out
        count = max(min(_CHUNK, r.limit - start), need)
        r.buf = generate(
            r.key, start, count, cfg.vocab_size,
            avoid=r.all_stop if r.min_tokens else (), avoid_before=r.min_tokens,
            allowed=r.allowed, eos_token_id=cfg.eos_token_id,
            eos_probability=cfg.eos_probability,
        )
        r.buf_start = start
        r.buf_end = start + len(r.buf)
        set_plain(r, r.plain)

    def _row(self, r: Request, toks: list[int], finish: int | None, reason: int | None,
             aux: dict[int, list[bytes | memoryview]], now: float) -> bytes:
        """The general (slow) path: a row with logprobs, events, prefill stats or a finish."""
        cfg = self.config
        frames: list[bytes | memoryview] | None = None
        logprobs = None
        if r.logprobs is not None:
            frames = aux.setdefault(r.client, [b""])
            lp = fake_logprobs(r.key, toks, r.num_out - len(toks), r.logprobs, cfg.vocab_size,
                               greedy=r.greedy)
            logprobs = encode_logprobs(lp, frames)
        prompt_logprobs = None
        if r.want_prompt_logprobs:
            r.want_prompt_logprobs = False
            assert r.prompt_logprobs is not None
            plp = fake_prompt_logprobs(r.prompt, r.prompt_logprobs, cfg.vocab_size)
            if plp is not None:
                frames = aux.setdefault(r.client, [b""])
                prompt_logprobs = encode_logprobs(plp, frames, prompt=True)
        events = None
        if r.events:
            events = [{"type": kind, "timestamp": ts} for kind, ts in r.events]
        r.events = None
        prefill, r.prefill = r.prefill, None
        row: list[Any] = [
            r.rid, toks, logprobs, prompt_logprobs, None, finish, reason, events, None, None,
            r.trace, prefill, None, 0, None, None, None, None, None,
        ]
        set_plain(r, r.logprobs is None)
        return pack(row[:cfg.output_fields])

    # ------------------------------------------------------------------ stats

    def _stats_bytes(self) -> bytes:
        cfg = self.config
        num_running = len(self._running)  # purged: only live requests remain
        num_waiting = len(self._waiting)
        used_blocks = -(-max(self._kv_tokens, 0) // cfg.block_size)
        usage = min(1.0, used_blocks / cfg.gpu_blocks)
        prefix_cache: dict[str, Any] | None = None
        if cfg.enable_prefix_caching:
            prefix_cache = {
                "reset": self._pc_reset, "requests": self._pc_requests,
                "queries": self._pc_queries, "hits": self._pc_hits,
                "preempted_requests": 0, "preempted_queries": 0, "preempted_hits": 0,
                "hits_by_source": {},
            }
            self._pc_reset = False
            self._pc_requests = self._pc_queries = self._pc_hits = 0
        spec = None
        if cfg.num_speculative_tokens:
            k = cfg.num_speculative_tokens
            spec = {
                "num_spec_tokens": k, "num_drafts": self._spec_drafts,
                "num_draft_tokens": self._spec_drafts * k,
                "num_accepted_tokens": self._spec_accepted,
                "num_accepted_tokens_per_pos": self._spec_accepted_pos,
                "num_draft_tokens_per_pos": [self._spec_drafts] * k,
            }
            self._spec_drafts = self._spec_accepted = 0
            self._spec_accepted_pos = [0] * k
        stats: dict[str, Any] = {
            "num_running_reqs": num_running,
            "num_waiting_reqs": num_waiting,
            "num_skipped_waiting_reqs": 0,
            "num_kv_fetch_reqs_by_stage": {"waiting_to_start": 0, "in_progress": 0,
                                           "completed_waiting": 0},
            "step_counter": 0,
            "current_wave": 0,
            "kv_cache_usage": float(usage),
            "iteration_details": None,
            "prefix_cache_stats": prefix_cache,
            "connector_prefix_cache_stats": None,
            "kv_cache_eviction_events": [],
            "spec_decoding_stats": spec,
            "kv_connector_stats": None,
            "ec_connector_stats": None,
            "waiting_lora_adapters": {},
            "running_lora_adapters": {},
            "cudagraph_stats": None,
            "perf_stats": None,
        }
        self.last_stats = SchedulerStats(
            num_running_reqs=num_running, num_waiting_reqs=num_waiting,
            kv_cache_usage=float(usage),
            prefix_cache_queries=prefix_cache["queries"] if prefix_cache else 0,
            prefix_cache_hits=prefix_cache["hits"] if prefix_cache else 0, raw=stats,
        )
        return pack(stats)
