"""The static engine-flag lists of ``anyio-genout serve`` against vLLM's own parser.

Needs vLLM importable (the interop venv: ``nox -s interop``); skipped elsewhere.
"""

from __future__ import annotations

import warnings

import pytest

from anyio_genout.cli.vllm_flags import ENGINE_FLAGS, ENGINE_SWITCHES

#: EngineArgs flags the front end handles itself (docs/server.md "Coming from vllm serve").
FRONT_END = {"data-parallel-address", "data-parallel-rpc-port", "data-parallel-size",
             "served-model-name", "model", "reasoning-parser", "max-logprobs", "help",
             "shutdown-timeout", "stream-interval", "generation-config",
             "override-generation-config", "tokenizer"}


def test_the_engine_flags_are_vllms() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # vLLM's and torch's import-time deprecation noise
        pytest.importorskip("vllm", reason="needs vLLM (the interop venv)")
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.utils.argparse_utils import FlexibleArgumentParser

        parser = FlexibleArgumentParser()
        AsyncEngineArgs.add_cli_args(parser)
    values, switches = set(), set()
    for action in parser._actions:
        for option in action.option_strings:
            if option.startswith("--") and option[2:] not in FRONT_END:
                (switches if action.nargs == 0 else values).add(option[2:])
    assert values == ENGINE_FLAGS
    assert switches == ENGINE_SWITCHES
