"""One step of the mock engine: a token for every running request, packed into output rows.

:class:`Stepper` is the part of :class:`~.engine.MockEngine` that steps; it is given the
engine's :class:`~.scheduler.Scheduler` and :class:`~.wire.OutputWriter` and uses their
public methods (and, in the hot loop, the scheduler's ``running`` list). A step admits
waiting requests (or, injected, preempts one), generates one token per running request (1
to 1+k with speculative decoding, plus the outputs owed after an abort under
``late_outputs_after_abort``), hands finished requests back to the scheduler, and sends one
``EngineCoreOutputs`` per client, the scheduler stats on the first.

``_generate`` is the hot loop (it caches what it reads in locals): a plain row is appended
as three pre-packed parts (see :mod:`.wire`); only rows with logprobs, events, prefill stats
or a finish are packed whole, by ``_row``. Tokens come from :mod:`.tokens`, ``_CHUNK`` at a
time per request.
"""

from __future__ import annotations

import time
from typing import Any, Final

from ..protocol import SchedulerStats
from ..protocol.logprobs import encode_logprobs
from .config import MockEngineConfig
from .request import Request, check_stop, set_plain
from .scheduler import Pause, Scheduler
from .tokens import (
    alternatives_table,
    corpus_array,
    fake_logprobs,
    fake_prompt_logprobs,
    generate,
)
from .wire import OutputWriter, array_header, pack

__all__ = ["Stepper"]

#: Tokens generated per refill of a request's token buffer.
_CHUNK: Final = 256


class Stepper:
    """The step (the stepping part of :class:`~.engine.MockEngine`).

    ``steps`` counts the steps run; ``last_stats`` is the last ``SchedulerStats`` sent.
    """

    def __init__(self, config: MockEngineConfig, scheduler: Scheduler,
                 writer: OutputWriter) -> None:
        self.config = config
        self.steps = 0
        self.last_stats: SchedulerStats | None = None
        self._spec_drafts = self._spec_accepted = 0
        self._spec_accepted_pos: list[int] = [0] * config.num_speculative_tokens
        self._scheduler = scheduler
        self._writer = writer
        self._tokb = writer.token_bytes
        corpus = config.corpus_token_ids
        self._corpus = None if corpus is None else corpus_array(corpus)
        alternatives = config.alternative_token_ids
        self._alternatives = (None if alternatives is None
                              else alternatives_table(alternatives))

    # ------------------------------------------------------------------ the step

    def step(self) -> None:
        """Run one step and send its outputs (the writer may queue them: see
        :attr:`~.wire.OutputWriter.blocked`)."""
        cfg = self.config
        sched = self._scheduler
        writer = self._writer
        now = time.monotonic()
        self.steps += 1
        sched.owes_stats = False
        preempt_every = cfg.faults.preempt_every
        if preempt_every is not None and self.steps % preempt_every == 0 and sched.running:
            sched.preempt_last(now)  # the scheduler admits nobody this step
        elif sched.pause is Pause.UNPAUSED:
            sched.admit(now)
            if writer.dead:
                return
        # Per client: packed rows, three parts per row (row bytes may be split in three).
        rows: list[list[bytes]] = [[] for _ in range(writer.num_clients)]
        aux: dict[int, list[bytes | memoryview]] = {}
        finished: list[Request] = []
        if cfg.num_speculative_tokens:
            emitted = self._generate_spec(rows, aux, finished, now)
        else:
            emitted = self._generate(rows, aux, finished, now)
        if sched.zombies:
            self._generate_late(rows)
        sched.account(emitted, finished)
        stats = self.stats_bytes() if cfg.log_stats else b"\xc0"
        sent = False
        send_message = writer.send_message
        for client, parts in enumerate(rows):
            if parts:
                send_message(client, parts, stats, weight_version=True, aux=aux.get(client))
                stats = b"\xc0"  # vLLM attaches the stats to the first client's message
                sent = True
        if not sent and cfg.log_stats:
            send_message(0, [], stats, weight_version=True)

    def _generate(self, rows: list[list[bytes]], aux: dict[int, list[bytes | memoryview]],
                  finished: list[Request], now: float) -> int:
        """One token per running request: the hot loop."""
        tokb = self._tokb
        running = self._scheduler.running
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
        for r in self._scheduler.running:
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
        sched = self._scheduler
        for r in sched.zombies:
            if r.num_out >= r.buf_end:
                self._refill(r, 1)
            tok = r.buf[r.num_out - r.buf_start]
            r.num_out += 1
            r.late -= 1
            rows[r.client].extend((r.prefix, tokb[tok], r.mid))
        sched.settle_late()

    def _refill(self, r: Request, need: int) -> None:
        cfg = self.config
        start = r.num_out
        count = max(min(_CHUNK, r.limit - start), need)
        if r.bad_words:
            # A word's last token is banned after the rest of it: the outputs before
            # ``start`` (those before the old buffer, and the old buffer's up to ``start``).
            keep = max(len(w) for w in r.bad_words) - 1
            if keep:
                r.bad_tail = [*r.bad_tail, *r.buf[:start - r.buf_start]][-keep:]
        r.buf = generate(
            r.key, r.offset + start, count, cfg.vocab_size,
            avoid=r.all_stop if r.min_tokens else (), avoid_before=r.offset + r.min_tokens,
            allowed=r.allowed, eos_token_id=cfg.eos_token_id,
            eos_probability=cfg.eos_probability, corpus=self._corpus,
            starts=cfg.corpus_starts, bad_words=r.bad_words, history=r.bad_tail,
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
            lp = fake_logprobs(r.key, toks, r.offset + r.num_out - len(toks), r.logprobs,
                               cfg.vocab_size, greedy=r.greedy,
                               alternatives=self._alternatives)
            logprobs = encode_logprobs(lp, frames)
        prompt_logprobs = None
        if r.want_prompt_logprobs:
            r.want_prompt_logprobs = False
            assert r.prompt_logprobs is not None
            plp = fake_prompt_logprobs(r.prompt, r.prompt_logprobs, cfg.vocab_size,
                                       alternatives=self._alternatives)
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

    def stats_bytes(self) -> bytes:
        """The packed ``SchedulerStats`` of now (sets ``last_stats``; resets the counters)."""
        cfg = self.config
        sched = self._scheduler
        num_running = len(sched.running)  # purged: only live requests remain
        num_waiting = len(sched.waiting)
        usage = sched.kv_cache_usage()
        prefix_cache = sched.take_prefix_cache_stats()
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
