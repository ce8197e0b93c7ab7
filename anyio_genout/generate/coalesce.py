"""Coalescing: the outputs of one request that wait in its buffer, handed over as one.

When a consumer was busy and several engine steps of its request arrived meanwhile,
:class:`~anyio_genout.GenerateStream` delivers them as **one** :class:`GenerateOutput`
(vLLM's ``RequestOutputCollector`` merges the same way with ``RequestOutput.add``), so what
a delivery costs (the call, the output object, the caller's loop body) is paid once per
wake-up, not once per engine step. The merged output holds:

* ``token_ids``: every step's tokens, in order; ``logprobs`` and ``sampling_mask``: their
  rows stacked in the same order;
* ``finish_reason``: the last step's (the merge ends with the terminal output);
* ``prompt_info``: the first step's; ``cached_token_count``: the largest of the steps';
* ``kv_transfer_params``, ``ec_transfer_params``, ``spec_decode_metrics``: the one step's
  that carries them (a step that would bring a second value starts the next delivery).

A step joins only outputs of the same shape: logprobs on both or on neither (a step without
tokens joins any), the same logprobs columns, a sampling mask on both or neither, rows that
match its tokens. Anything else (an error, the end of the stream) is left for the next
delivery, as are the steps after a stop token sequence's match (the stream is closed there,
so they are dropped as before). Every step is observed by the metrics on its own, exactly as
without coalescing (inter-token latency per step). ``client.generate(request,
per_step=True)`` turns it off: one output per engine step.
"""

from __future__ import annotations

import time
from typing import Any, Final

import attrs

from ..engine import EngineCoreOutputStream
from ..metrics import RequestTracker
from ..protocol import EngineCoreFinishReason, EngineCoreOutput, Logprobs, SamplingMask
from .stop_sequences import StopSequenceMatcher

__all__ = ["MAX_MERGED", "Merge", "gather"]

#: The most engine steps one delivery merges (what is left stays buffered for the next one).
#: At 64 the per-delivery cost is already paid once per 64 steps; a cap keeps a consumer
#: whose work grows with the tokens of an output (the text layer, an SSE event) within the
#: checkpoint policy's bound: its turn is checked between deliveries, not inside one.
MAX_MERGED: Final = 64


@attrs.define(slots=True, eq=False)
class Merge:
    """Several buffered steps of one request added up (the first one's fields to begin)."""

    tokens: list[int]
    logprobs: list[Logprobs] | None
    masks: list[SamplingMask] | None
    cached: int
    kv_params: dict[str, Any] | None
    ec_params: dict[str, Any] | None
    spec_metrics: dict[str, Any] | None
    #: Neither a finish nor logprobs, prefill stats, mask or transfer params on any step.
    plain: bool
    finish_reason: EngineCoreFinishReason | None = None
    stop_reason: int | str | None = None
    #: The wall-clock arrival of the terminal step (0.0 until one joins).
    received_at: float = 0.0
    #: A stop token sequence's match: (tokens of the merge to keep, the sequence).
    matched: tuple[int, tuple[int, ...]] | None = None
    steps: int = 1

    @classmethod
    def start(cls, tokens: list[int], logprobs: Logprobs | None, mask: SamplingMask | None,
              cached: int, kv_params: dict[str, Any] | None, ec_params: dict[str, Any] | None,
              spec_metrics: dict[str, Any] | None, plain: bool) -> Merge:
        """A merge that begins with a step of these fields (``tokens`` is copied)."""
        return cls(list(tokens), None if logprobs is None else [logprobs],
                   None if mask is None else [mask], cached, kv_params, ec_params,
                   spec_metrics, plain)

    def result(self, received_at: float) -> tuple[
            list[int], Logprobs | None, SamplingMask | None, int, dict[str, Any] | None,
            dict[str, Any] | None, dict[str, Any] | None, EngineCoreFinishReason | None,
            int | str | None, tuple[int, tuple[int, ...]] | None, float]:
        """(tokens, logprobs, mask, cached, kv_params, ec_params, spec_metrics, finish_reason,
        stop_reason, matched, received_at): the merged step's fields, ``received_at`` the
        first step's arrival unless the merge ends with a finish or a match."""
        end = self.finish_reason is not None or self.matched is not None
        return (self.tokens,
                None if self.logprobs is None else Logprobs.concat(self.logprobs),
                None if self.masks is None else SamplingMask.concat(self.masks),
                self.cached, self.kv_params, self.ec_params, self.spec_metrics,
                self.finish_reason, self.stop_reason, self.matched,
                self.received_at if end else received_at)


def _joins(merge: Merge, output: EngineCoreOutput) -> bool:
    """Whether ``output`` can be added to ``merge`` without losing or misaligning a row."""
    n = len(output.new_token_ids)
    lp = output.new_logprobs
    if lp is None:
        if n and merge.logprobs is not None:
            return False
    elif (len(lp) != n or (merge.logprobs is None and merge.tokens)
          or (merge.logprobs and merge.logprobs[0].token_ids.shape[1:] != lp.token_ids.shape[1:])):
        return False
    mask = output.new_sampling_mask
    if mask is None:
        if n and merge.masks is not None:
            return False
    elif len(mask) != n or (merge.masks is None and merge.tokens):
        return False
    return ((output.spec_decode_metrics is None or merge.spec_metrics is None)
            and (output.kv_transfer_params is None or merge.kv_params is None)
            and (output.ec_transfer_params is None or merge.ec_params is None))


def _add_plain_run(merge: Merge, steps: list[Any], new: list[int], tracker: RequestTracker,
                   matcher: StopSequenceMatcher | None) -> bool:
    """Add a run of plain steps (:meth:`~.EngineCoreOutputStream.take_plain`'s: ``steps``
    a flat list of each one's batch timestamp and token count, ``new`` their token ids in
    order) to ``merge``, the steps observed by ``tracker``; True if a stop token sequence
    matched (the steps after it are dropped unobserved: the stream closes there, as it
    would drop them)."""
    tokens = merge.tokens
    if matcher is None:  # the common case: the whole run at once
        tracker.observe_steps(steps, None)
        tokens.extend(new)
        merge.steps += len(steps) >> 1
        return False
    at = 0
    for i in range(0, len(steps), 2):
        step = new[at:at + steps[i + 1]]
        at += steps[i + 1]
        tracker.observe_steps(steps[i:i + 2], None)
        merge.steps += 1
        offset = len(tokens)
        tokens.extend(step)
        matched = matcher.feed(step)
        if matched is not None:
            merge.matched = (offset + matched[0], matched[1])
            merge.received_at = time.time()  # the finish's time
            merge.plain = False  # (a plain step has no stop reason to keep)
            return True
    return False


def gather(raw: EngineCoreOutputStream, tracker: RequestTracker,
           matcher: StopSequenceMatcher | None, continued: bool, merge: Merge) -> Merge:
    """Add to ``merge`` the steps buffered behind it in ``raw`` that join it (up to
    :data:`MAX_MERGED`), each observed by ``tracker`` as it is taken; stop after the
    terminal step or a stop sequence's match; returns ``merge``. ``continued``: the engine
    request running continues a moved one (its prefill stats are not the prompt's)."""
    tokens = merge.tokens
    if merge.logprobs is not None and len(merge.logprobs[0]) != len(tokens):
        return merge  # rows that do not match the first step's tokens: nothing to align to
    if merge.logprobs is None and merge.masks is None:
        # Plain steps (tokens alone) join such a merge whatever it holds: take the run of
        # them in one call, and only then what needs the general loop below.
        run = raw.take_plain(MAX_MERGED - merge.steps)
        if run is not None and _add_plain_run(merge, *run, tracker, matcher):
            return merge
    while merge.steps < MAX_MERGED:
        output = raw.peek_output()
        if output is None or not _joins(merge, output):
            return merge
        raw.receive_output_nowait()  # takes it: its batch timestamp is raw.timestamp
        finish_reason = output.finish_reason
        received_at = (time.time() if tracker.is_prefilling or finish_reason is not None
                       else 0.0)
        tracker.observe_output(raw.timestamp, received_at, output)
        merge.steps += 1
        new = output.new_token_ids
        offset = len(tokens)
        tokens.extend(new)
        lp = output.new_logprobs
        if lp is not None:
            merge.plain = False
            if merge.logprobs is None:
                merge.logprobs = [lp]
            else:
                merge.logprobs.append(lp)
        mask = output.new_sampling_mask
        if mask is not None:
            merge.plain = False
            if merge.masks is None:
                merge.masks = [mask]
            else:
                merge.masks.append(mask)
        prefill = output.prefill_stats
        if prefill is not None:
            merge.plain = False
            if not continued and prefill.num_cached_tokens > merge.cached:
                merge.cached = prefill.num_cached_tokens
        if output.kv_transfer_params is not None:
            merge.plain = False
            merge.kv_params = output.kv_transfer_params
        if output.ec_transfer_params is not None:
            merge.plain = False
            merge.ec_params = output.ec_transfer_params
        if output.spec_decode_metrics is not None:
            merge.plain = False
            merge.spec_metrics = output.spec_decode_metrics
        if matcher is not None:
            matched = matcher.feed(new)
            if matched is not None:
                merge.matched = (offset + matched[0], matched[1])
                merge.received_at = received_at or time.time()  # the finish's time
                merge.finish_reason = finish_reason
                merge.stop_reason = output.stop_reason
                merge.plain = False
                return merge
        if finish_reason is not None:
            merge.finish_reason = finish_reason
            merge.stop_reason = output.stop_reason
            merge.received_at = received_at
            merge.plain = False
            return merge
    return merge
