"""A ``vllm serve`` command line with ``vllm`` replaced by ``anyio-genout`` (issue 24 item 6),
and vLLM's small routes (item 7): the CLI as a subprocess, answered over real HTTP."""

from __future__ import annotations

import json
import shutil
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from anyio_genout.text.bundled import bundled_model_dir
from tests.cli.support import CLI, cli, free_port
from tests.server.support import serve_process

MODEL = str(bundled_model_dir())


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_vllm_serve_line_serves_with_engines_dialing_in(backend: str) -> None:
    port, rpc = free_port("127.0.0.1"), free_port("127.0.0.1")
    with serve_process(MODEL, "--api-server-count", "2", "--data-parallel-address",
                       "127.0.0.1", "--data-parallel-rpc-port", str(rpc),
                       "--data-parallel-size", "1", "--served-model-name", "org/m",
                       "--root-path", "/proxy", "--allowed-origins", '["http://ui.example"]',
                       "--port", str(port), "--backend", backend, ready=False,
                       exit_code=130) as server:
        engine = subprocess.Popen([*CLI, "mock-engine", "--handshake-address",
                                   f"tcp://127.0.0.1:{rpc}", "--model", MODEL],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  stdin=subprocess.DEVNULL)
        try:
            base = f"http://127.0.0.1:{port}"
            server.wait_ready()
            # ignore_eos: the mock may sample EOS first (then 1 token, not 3).
            body = {"model": "org/m", "prompt": "Once upon a time", "max_tokens": 3,
                    "ignore_eos": True}
            for path in ("/v1/completions", "/proxy/v1/completions"):  # with the prefix too
                answer = httpx.post(base + path, json=body)
                assert answer.status_code == 200, answer.text
                assert answer.json()["usage"]["completion_tokens"] == 3
            card = httpx.get(f"{base}/v1/models/org/m")
            assert card.status_code == 200 and card.json()["id"] == "org/m"
            preflight = httpx.options(f"{base}/v1/completions", headers={
                "origin": "http://ui.example", "access-control-request-method": "POST"})
            assert preflight.headers["access-control-allow-origin"] == "http://ui.example"
            other = httpx.options(f"{base}/v1/completions", headers={
                "origin": "http://evil.example", "access-control-request-method": "POST"})
            assert "access-control-allow-origin" not in other.headers
        finally:
            engine.terminate()
            engine.wait(timeout=20)


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_vllms_small_routes(backend: str) -> None:
    with serve_process("--backend", backend, "--served-model-name", "m", "--api-key", "k",
                       exit_code=130) as server:
        base = server.base
        for method in ("GET", "POST"):
            assert httpx.request(method, f"{base}/ping").status_code == 200
        version = httpx.get(f"{base}/version")  # open, as /health, without the key
        assert version.status_code == 200
        assert version.json() == {"version": cli("--version").stdout.split()[-1]}
        key = {"authorization": "Bearer k"}
        card = httpx.get(f"{base}/v1/models/m", headers=key).json()
        assert card == {**httpx.get(f"{base}/v1/models", headers=key).json()["data"][0],
                        "created": card["created"]}
        unknown = httpx.get(f"{base}/v1/models/nope", headers=key)
        assert unknown.status_code == 404
        assert unknown.json() == {"error": {"message": "The model `nope` does not exist.",
                                            "type": "NotFoundError", "param": "model",
                                            "code": 404}}
        assert httpx.get(f"{base}/v1/models/m").status_code == 401  # under /v1: the key


@pytest.mark.parametrize("line", [
    ["--gpu-memory-utilization", "0.9"],
    ["--data-parallel-address", "127.0.0.1", "--gpu-memory-utilization=0.9"],
])
def test_an_engine_flag_without_managed_engines_is_one_line_exit_2(line: list[str]) -> None:
    done = cli("serve", *line)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        "anyio-genout: error: --gpu-memory-utilization concerns the engine: give it to the "
        "engine (`vllm serve MODEL --headless --gpu-memory-utilization ...`); anyio-genout "
        "serve passes engine flags on only to engines it starts (MODEL or --vllm-model)"]


def test_engine_flags_go_to_the_engines_it_starts(tmp_path: Path) -> None:
    seen = tmp_path / "argv.json"
    fake = tmp_path / "fake_vllm.py"  # records its command line and exits: no engine
    fake.write_text(f"import json, sys\njson.dump(sys.argv[1:], open({str(seen)!r}, 'w'))\n")
    done = cli("serve", MODEL, "--gpu-memory-utilization", "0.9", "--enforce-eager",
               "--max-logprobs=5", "--tokenizer", MODEL,
               "--vllm-command", f"{sys.executable} {fake}", "--ready-timeout", "10")
    assert done.returncode == 1, done.stderr  # the "engine" exited at once
    argv = json.loads(seen.read_text())
    assert argv[:2] == ["serve", MODEL] and "--headless" in argv
    for flag in ("--gpu-memory-utilization", "--enforce-eager", "--max-logprobs=5",
                 f"--tokenizer={MODEL}"):  # the front end's own, passed on as vLLM's
        assert flag in argv
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.9"


@pytest.mark.parametrize(("line", "message"), [
    (["--tool-call-parser", "nope"], "--tool-call-parser: unknown tool parser 'nope'; known: "),
    (["--reasoning-parser", "nope"], "--reasoning-parser: unknown reasoning parser 'nope'; "
                                     "known: "),
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice requires --tool-call-parser"),
])
def test_bad_parser_flags_are_refused_in_one_line(line: list[str], message: str) -> None:
    done = cli("serve", *line)
    assert done.returncode == 2, done.stderr
    (only,) = done.stderr.splitlines()
    assert only.startswith(f"anyio-genout: error: {message}")
    if "known" in message:  # the names the registry has
        assert ("hermes" in only) if "tool" in message else ("deepseek_r1" in only)


def _self_signed(folder: Path) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command to make a certificate")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True,
                   timeout=60)
    return cert, key


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_tls_is_served(tmp_path: Path, backend: str) -> None:
    cert, key = _self_signed(tmp_path)
    port = free_port("127.0.0.1")
    with serve_process("--port", str(port), "--backend", backend, "--ssl-certfile", str(cert),
                       "--ssl-keyfile", str(key), ready=False, exit_code=130) as server:
        trusted = ssl.create_default_context(cafile=str(cert))
        with httpx.Client(base_url=f"https://127.0.0.1:{port}", verify=trusted) as client:
            server.wait_ready(client)
            answer = client.post("/v1/completions", json={"prompt": "Once", "max_tokens": 2})
            assert answer.status_code == 200, answer.text
        with pytest.raises(httpx.TransportError):  # plain HTTP is not served there
            httpx.get(f"http://127.0.0.1:{port}/health")


def test_an_ssl_file_alone_is_refused(tmp_path: Path) -> None:
    done = cli("serve", "--ssl-certfile", str(tmp_path / "cert.pem"))
    assert done.returncode == 2
    assert "--ssl-keyfile and --ssl-certfile go together" in done.stderr


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_unix_socket_is_served(tmp_path: Path, backend: str) -> None:
    path = tmp_path / "genout.sock"
    with serve_process("--uds", str(path), "--backend", backend, exit_code=130) as server:
        deadline = time.monotonic() + 20
        while not path.exists():  # bound before the engines are up: then it queues
            server.alive()
            assert time.monotonic() < deadline, "the socket was not bound"
            time.sleep(0.05)
        transport = httpx.HTTPTransport(uds=str(path))
        with httpx.Client(transport=transport, base_url="http://localhost",
                          timeout=20) as client:
            assert client.get("/health").status_code == 200
            answer = client.post("/v1/completions", json={"prompt": "Once", "max_tokens": 2})
            assert answer.status_code == 200, answer.text
    assert not path.exists()  # removed on the way out


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
@pytest.mark.parametrize("where", ["inline", "file"])
def test_chat_template_replaces_the_folders(tmp_path: Path, backend: str, where: str) -> None:
    template = "{% for m in messages %}<<{{ m.content }}>>{% endfor %}"
    if where == "file":
        (tmp_path / "t.jinja").write_text(template, encoding="utf-8")
        template = str(tmp_path / "t.jinja")
    with serve_process("--backend", backend, "--api-server-count", "2", "--chat-template",
                       template, exit_code=130) as server:
        base = server.base
        tokens = httpx.post(f"{base}/tokenize", json={
            "messages": [{"role": "user", "content": "Once upon"}]}).json()["tokens"]
        prompt = httpx.post(f"{base}/detokenize", json={"tokens": tokens}).json()["prompt"]
        assert prompt == "<<Once upon>>"


def test_a_chat_template_path_that_does_not_open_is_refused(tmp_path: Path) -> None:
    done = cli("serve", "--chat-template", str(tmp_path / "missing.jinja"))
    assert done.returncode == 2
    assert done.stderr.splitlines()[-1].startswith(
        "anyio-genout: error: --chat-template '")
    assert "looks like a file path, but it cannot be read" in done.stderr


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_max_logprobs_bounds_what_a_request_may_ask(backend: str) -> None:
    with serve_process("--backend", backend, "--max-logprobs", "2", exit_code=130) as server:
        base = server.base
        body = {"prompt": "Once", "max_tokens": 2}
        ok = httpx.post(f"{base}/v1/completions", json={**body, "logprobs": 2})
        assert ok.status_code == 200, ok.text
        too_many = httpx.post(f"{base}/v1/completions", json={**body, "logprobs": 3})
        assert too_many.status_code == 400, too_many.text
        assert "max_logprobs=2" in too_many.json()["error"]["message"]


def test_no_option_of_serve_is_taken_for_an_engine_flag() -> None:
    """An option ``serve`` has itself is never split off as vLLM's engine flag (then refused,
    or passed to an engine that would not drain): ``--shutdown-timeout`` was, once."""
    from anyio_genout.cli.main import build_parser
    from anyio_genout.cli.vllm_flags import ENGINE_FLAGS, ENGINE_SWITCHES, split_engine_flags

    parser = build_parser()
    serve = next(action for action in parser._actions
                 if isinstance(action, type(parser._subparsers._group_actions[0]))
                 ).choices["serve"]
    options = {option[2:] for action in serve._actions
               for option in action.option_strings if option.startswith("--")}
    assert not options & (ENGINE_FLAGS | ENGINE_SWITCHES)
    rest, engine = split_engine_flags(["--shutdown-timeout", "5", "--block-size", "16"])
    assert rest == ["--shutdown-timeout", "5"] and engine == ["--block-size", "16"]
