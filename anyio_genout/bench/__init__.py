"""``anyio-genout bench``: delivered tokens per second and client CPU per token.

The engine is the mock engine core (:mod:`anyio_genout.mock`) in its own process, stepping as
fast as it can; the client runs in the benchmark process, so the benchmark process's CPU time
is the client's cost. Every measured combination of implementation, backend and workload (a
*cell*) runs in a fresh subprocess (:mod:`.cell`) with its own engine process.

Implementations: ``ours`` (:class:`~anyio_genout.Client` on asyncio, asyncio+uvloop and
trio), ``floor`` (a bare synchronous pyzmq client that only unpacks messages and counts
tokens: what any Python front end must at least spend) and ``vllm`` (vLLM's ``AsyncLLM``
with an external engine, run by ``nox -s bench-vllm`` in the interop environment).

This package measures; it is a library and imports nothing from :mod:`anyio_genout.cli`.
Its command line, ``anyio-genout bench`` (the parser, one module per command, their options
and printing), is :mod:`anyio_genout.cli.bench`.

Modules: :mod:`.attempts` (a cell in a fresh process, retried while the machine was busy, the
quietest attempt kept), :mod:`.cell` (that process), :mod:`.spec` (cell descriptions and
results), :mod:`.measure` (CPU, wall and memory meters, the engine process), :mod:`.ours`,
:mod:`.floor`, :mod:`.vllm_ref` (the three implementations), :mod:`.lateness` (cancel
lateness), :mod:`.report` (ratios, targets, the table), :mod:`.plot` (the PNG) and
:mod:`.profile` (profile summaries). ``bench text`` (the text layer's cost per token, ours
and AsyncLLM's detokenizing): :mod:`.text` (our cells), :mod:`.text_vllm` and
:mod:`.text_report`. ``bench server``: :mod:`.server_procs` (the servers and their engines),
:mod:`.server_report` and :mod:`.vllm_rs` (the load generator). ``bench routing``:
:mod:`.routing`.
"""

from __future__ import annotations

__all__: list[str] = []
