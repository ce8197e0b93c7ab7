"""``nox -s bench-attack``: can one client's request freeze ``anyio-genout serve``?

For each backend and scenario it starts ``anyio-genout serve`` (embedded mock engine, one
step every 10 ms) as a subprocess, keeps 4 completions streaming and polls ``/health``
every 20 ms from this process, and, after a second, starts an attacker process: 10 clients
each sending the attack request in a loop for ``--seconds``. It reports ``/health``
latency and the streams' inter-event gap (p50, p99, max) and what the attack requests got.

Scenarios: ``baseline`` (no attack), ``prompt`` (a ~1 MiB text prompt, which the context
cannot fit), ``template-trusted`` (a request chat template of two nested
``range(6000)`` loops, the server started with ``--trust-request-chat-template``) and
``template-refused`` (the same, without the flag). ``--pythonpath DIR`` runs the server
from another tree (``git worktree add /tmp/base <commit>``): the code before has no flag,
so its ``template`` scenario is the template rendered as it was (no flag needed).

    python benchmarks/bench_attack.py --label after --out bench-results/attack.md
    python benchmarks/bench_attack.py --label before --pythonpath /tmp/base --old \\
        --out bench-results/attack.md

The table is appended to ``--out``. Timings depend on the machine's load: say so.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import httpx

PROMPT = "The keeper wrote the weather in the ledger. " * 22_000
RUNAWAY = "{% for i in range(6000) %}{% for j in range(6000) %}{% endfor %}{% endfor %}x"
MODEL = "bench"


def _attack_body(kind: str) -> tuple[str, bytes]:
    if kind == "prompt":
        return "/v1/completions", json.dumps(
            {"model": MODEL, "prompt": PROMPT, "max_tokens": 4}).encode()
    return "/v1/chat/completions", json.dumps(
        {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
         "chat_template_kwargs": {"chat_template": RUNAWAY}}).encode()


async def _attacker(url: str, kind: str, clients: int, seconds: float) -> None:
    path, body = _attack_body(kind)
    statuses: dict[str, int] = {}
    latencies: list[float] = []

    async def one(http: httpx.AsyncClient) -> None:
        while True:
            start = time.perf_counter()
            try:
                answer = await http.post(path, content=body,
                                         headers={"content-type": "application/json"})
                key = str(answer.status_code)
            except httpx.HTTPError as exc:
                key = type(exc).__name__
            latencies.append(time.perf_counter() - start)
            statuses[key] = statuses.get(key, 0) + 1

    async with httpx.AsyncClient(base_url=url, timeout=120,
                                 limits=httpx.Limits(max_connections=clients)) as http:
        with anyio.move_on_after(seconds):
            async with anyio.create_task_group() as tg:
                for _ in range(clients):
                    tg.start_soon(one, http)
    latencies.sort()
    print(json.dumps({"statuses": statuses, "answered": len(latencies),
                      "median_s": latencies[len(latencies) // 2] if latencies else None}))


def _quantiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": float("nan"), "p99": float("nan"), "max": float("nan"), "n": 0}
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"p50": at(0.50), "p99": at(0.99), "max": ordered[-1], "n": len(ordered)}


async def _measure(url: str, attack: list[str] | None, seconds: float) -> dict[str, Any]:
    health: list[float] = []
    gaps: list[float] = []
    pending: dict[int, float] = {}
    waiting: dict[int, float] = {}  # stream -> when its last event came
    stop = anyio.Event()

    async def poll(http: httpx.AsyncClient) -> None:
        while not stop.is_set():
            start = time.perf_counter()
            pending[0] = start
            try:
                await http.get("/health")
            finally:
                del pending[0]
            health.append(time.perf_counter() - start)
            await anyio.sleep(0.02)

    async def stream(index: int, http: httpx.AsyncClient) -> None:
        body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 200,
                "stream": True}
        while not stop.is_set():
            async with http.stream("POST", "/v1/completions", json=body) as answer:
                waiting.pop(index, None)
                async for line in answer.aiter_lines():
                    if line.startswith("data: "):
                        now = time.perf_counter()
                        if index in waiting:
                            gaps.append(now - waiting[index])
                        waiting[index] = now
                waiting.pop(index, None)

    result: dict[str, Any] = {}
    async with httpx.AsyncClient(base_url=url, timeout=300) as http, \
            anyio.create_task_group() as tg:
        tg.start_soon(poll, http)
        for index in range(4):
            tg.start_soon(stream, index, http)
        await anyio.sleep(1.0)
        if attack is not None:
            attacker = await anyio.run_process(attack, check=False)
            result["attack"] = json.loads(attacker.stdout.decode().strip().splitlines()[-1]
                                          or "{}")
        else:
            await anyio.sleep(seconds)
        stop.set()
        now = time.perf_counter()
        for started in pending.values():  # a /health still unanswered counts as waited
            health.append(now - started)
        gaps.extend(now - last for last in waiting.values())  # so does a stream's wait
        tg.cancel_scope.cancel()
    result["health"] = _quantiles(health)
    result["gap"] = _quantiles(gaps)
    return result


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _scenario(backend: str, scenario: str, args: argparse.Namespace) -> dict[str, Any]:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    options = ["--port", str(port), "--backend", backend, "--mock-step-time", "0.01",
               "--served-model-name", MODEL]
    if scenario == "template-trusted" and not args.old:
        options.append("--trust-request-chat-template")
    env = dict(os.environ)
    if args.pythonpath:
        env["PYTHONPATH"] = args.pythonpath
    # From the tree's own folder: ``python -m`` puts the working directory first on the path.
    server = subprocess.Popen([sys.executable, "-m", "anyio_genout", "serve", *options],
                              env=env, cwd=args.pythonpath or None, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the server did not start ({scenario}, {backend})")
            time.sleep(0.1)
        attack = None
        if scenario != "baseline":
            kind = "prompt" if scenario == "prompt" else "template"
            attack = [sys.executable, __file__, "--attacker", kind, "--url", url,
                      "--seconds", str(args.seconds), "--clients", str(args.clients)]
        return anyio.run(_measure, url, attack, args.seconds, backend="asyncio")
    finally:
        server.send_signal(signal.SIGKILL if scenario != "baseline" else signal.SIGINT)
        server.wait(timeout=30)


def _row(label: str, backend: str, scenario: str, r: dict[str, Any]) -> str:
    h, g = r["health"], r["gap"]
    attack = r.get("attack")
    got = "" if attack is None else ", ".join(
        f"{n}x {k}" for k, n in sorted(attack["statuses"].items())) + (
        f" (median {attack['median_s']:.2f} s)" if attack.get("median_s") is not None else "")

    def ms(seconds: float) -> str:
        return f"{seconds * 1000:.0f}"

    return (f"| {label} | {backend} | {scenario} | {ms(h['p50'])} / {ms(h['p99'])} / "
            f"{ms(h['max'])} | {ms(g['p50'])} / {ms(g['p99'])} / {ms(g['max'])} | {got} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--attacker", choices=("prompt", "template"))
    parser.add_argument("--url")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--backends", default="asyncio,trio")
    parser.add_argument("--scenarios",
                        default="baseline,prompt,template-trusted,template-refused")
    parser.add_argument("--pythonpath", help="run the server from this tree")
    parser.add_argument("--old", action="store_true",
                        help="the server has no --trust-request-chat-template (renders "
                             "request templates as it is); skips template-refused")
    parser.add_argument("--label", default="after")
    parser.add_argument("--out", type=Path, default=Path("bench-results/attack.md"))
    args = parser.parse_args()
    if args.attacker:
        anyio.run(_attacker, args.url, args.attacker, args.clients, args.seconds)
        return
    rows = []
    for backend in args.backends.split(","):
        for scenario in args.scenarios.split(","):
            if args.old and scenario == "template-refused":
                continue
            result = _scenario(backend, scenario, args)
            shown = "template (no flag existed)" if args.old and scenario == \
                "template-trusted" else scenario
            rows.append(_row(args.label, backend, shown, result))
            print(rows[-1], flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    new = not args.out.exists()
    with args.out.open("a") as out:
        if new:
            out.write("| code | backend | scenario | /health p50 / p99 / max (ms) | "
                      "stream gap p50 / p99 / max (ms) | attack requests got |\n"
                      "|---|---|---|---|---|---|\n")
        out.write("\n".join(rows) + "\n")


if __name__ == "__main__":
    main()
