"""``anyio-genout run`` over inputs of any size: streamed input, --resume, ``-o -``, and the
lines an engine would refuse (each fails alone)."""

from __future__ import annotations

import io
import json
import subprocess
import threading
from pathlib import Path

import anyio
import pytest

from anyio_genout import (
    Client,
    ClientConfig,
    EngineCoreClientConfig,
    GenerateRequest,
    HandshakeTransport,
)
from anyio_genout.cli.run_cmd import run_all
from anyio_genout.cli.run_input import BadLine, LineParser, LineReader, scan
from anyio_genout.cli.run_output import Job
from anyio_genout.mock import MockEngine, MockEngineConfig
from anyio_genout.transport import free_tcp_address
from tests.support import wait_until

from .support import (
    BACKEND_PAIRS,
    CLI,
    COMMAND_TIMEOUT,
    assert_finished_result,
    cli,
    cli_process,
    complete_lines,
    read_results,
    request_line,
    running,
    write_lines,
)


def lines_for(count: int, max_tokens: int = 3) -> list[str]:
    return [request_line(f"r{i:03d}", [1, 2, i], max_tokens=max_tokens, ignore_eos=True)
            for i in range(count)]


def test_lines_an_engine_would_refuse_fail_alone_and_later_lines_run(tmp_path: Path) -> None:
    lines = lines_for(8)
    # The embedded mock's vocabulary is the shipped tokenizer's 1024 tokens.
    lines[2] = request_line("oov", [1, 1024], max_tokens=3)  # kills the mock if sent
    lines[5] = request_line("long", [1, 2, 3], max_tokens=5000)  # beyond its 4096 context
    requests = write_lines(tmp_path / "requests.jsonl", lines)
    results = tmp_path / "results.jsonl"
    done = cli("run", str(requests), "-o", str(results), "--no-progress")
    assert done.returncode == 1, done.stderr
    by_id = {line["request_id"]: line for line in read_results(results)}
    assert len(by_id) == 8
    assert by_id.pop("oov")["error"].startswith("InvalidRequestError: ")
    long = by_id.pop("long")["error"]
    assert long.startswith("InvalidRequestError: ") and (
        "max_tokens=5000 cannot be greater than max_model_len=4096" in long)
    for result in by_id.values():  # every other line ran, before and after the bad ones
        assert_finished_result(result)
        assert len(result["token_ids"]) == 3
    err = done.stderr.strip().splitlines()
    assert err[0].startswith("anyio-genout: 6/8 done, 2 failed, 0 skipped")
    assert err[1].startswith("anyio-genout: failed: oov: InvalidRequestError: ")
    assert "prompt_token_ids[1]: 1024 is not in the vocabulary (0..1023)" in err[1]
    assert err[2].startswith("anyio-genout: failed: long: InvalidRequestError: ")
    assert err[2].endswith("max_tokens: max_tokens=5000 cannot be greater than "
                           "max_model_len=4096. Please request fewer output tokens.")
    assert "EngineDeadError" not in done.stderr


def test_output_dash_writes_the_results_to_stdout(tmp_path: Path) -> None:
    requests = write_lines(tmp_path / "requests.jsonl", lines_for(5))
    done = subprocess.run([*CLI, "run", str(requests), "-o", "-"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=COMMAND_TIMEOUT,
                          stdin=subprocess.DEVNULL, check=False)
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / "-").exists()
    results = [json.loads(line) for line in done.stdout.splitlines()]
    assert sorted(r["request_id"] for r in results) == [f"r{i:03d}" for i in range(5)]
    for result in results:
        assert_finished_result(result)
    assert done.stderr.strip().splitlines()[-1].startswith(
        "anyio-genout: 5/5 done, 0 failed, 0 skipped")


def test_logprobs_asked_for_in_a_line_are_in_its_result(tmp_path: Path) -> None:
    requests = write_lines(tmp_path / "requests.jsonl", [
        request_line("lp", [1, 2, 3], max_tokens=4, ignore_eos=True, logprobs=2,
                     temperature=0.0),
        request_line("plain", [1, 2, 3], max_tokens=4, ignore_eos=True)])
    results = tmp_path / "results.jsonl"
    done = cli("run", str(requests), "-o", str(results), "--no-progress")
    assert done.returncode == 0, done.stderr
    by_id = {line["request_id"]: line for line in read_results(results)}
    assert "logprobs" not in by_id["plain"]
    rows = by_id["lp"]["logprobs"]
    assert len(rows) == len(by_id["lp"]["token_ids"]) == 4
    for token, row in zip(by_id["lp"]["token_ids"], rows, strict=True):
        assert len(row) == 3  # the sampled token, then the 2 most likely
        assert row[0][0] == token and row[0][2] >= 1
        assert all(logprob <= 0 for _, logprob, _ in row)
        assert [rank for _, _, rank in row[1:]] == [1, 2]


def test_resume_keeps_finished_results_and_reruns_the_rest(tmp_path: Path) -> None:
    requests = write_lines(tmp_path / "requests.jsonl", lines_for(10))
    results = tmp_path / "results.jsonl"
    first = cli("run", str(requests), "-o", str(results), "--no-progress")
    assert first.returncode == 0, first.stderr
    complete = results.read_text(encoding="utf-8").splitlines(keepends=True)
    # As an interrupted job leaves it: 6 results, one of them an error, then a partial line.
    error = json.dumps({"request_id": json.loads(complete[3])["request_id"],
                        "error": "EngineDeadError: gone"}) + "\n"
    kept = complete[:3] + complete[4:6]
    results.write_text("".join([*complete[:3], error, *complete[4:6]]) + complete[6][:40],
                       encoding="utf-8")

    again = cli("run", str(requests), "-o", str(results), "--resume", "--no-progress")
    assert again.returncode == 0, again.stderr
    assert (f"resuming: 5 finished result(s) in {results} kept, 2 error or truncated line(s) "
            "dropped to run again") in again.stderr
    assert "10/10 done, 0 failed, 0 skipped" in again.stderr
    assert "(5 kept from an earlier run)" in again.stderr
    text = results.read_text(encoding="utf-8")
    assert text.startswith("".join(kept))  # the finished results, byte for byte
    lines = read_results(results)
    assert sorted(line["request_id"] for line in lines) == [f"r{i:03d}" for i in range(10)]
    for line in lines:
        assert_finished_result(line)

    # Nothing left: a third run runs nothing and changes nothing.
    third = cli("run", str(requests), "-o", str(results), "--resume", "--no-progress")
    assert third.returncode == 0, third.stderr
    assert results.read_text(encoding="utf-8") == text


def test_resume_truncates_a_partial_last_line_in_place(tmp_path: Path) -> None:
    requests = write_lines(tmp_path / "requests.jsonl", lines_for(4))
    results = tmp_path / "results.jsonl"
    assert cli("run", str(requests), "-o", str(results), "--no-progress").returncode == 0
    complete = results.read_text(encoding="utf-8").splitlines(keepends=True)
    results.write_text("".join(complete[:2]) + complete[2][:-1], encoding="utf-8")  # no \n
    again = cli("run", str(requests), "-o", str(results), "--resume", "--no-progress")
    assert again.returncode == 0, again.stderr
    lines = read_results(results)
    assert [json.dumps(line, separators=(",", ":")) + "\n" for line in lines[:2]] == \
        complete[:2]
    assert sorted(line["request_id"] for line in lines) == [f"r{i:03d}" for i in range(4)]


TRICKY_IDS = [
    '{"request_id": "a", "prompt_token_ids": [1]}',
    '{"prompt_token_ids": [1], "request_id": "a"}',  # 2: a
    '{"request_id": "q\\"x", "prompt_token_ids": [1]}',
    '{"request_id": "q\\"x", "prompt_token_ids": [1]}',  # 4: an escaped quote
    '{"request_id": "z", "request_id": "y", "prompt_token_ids": [1]}',  # JSON keeps "y"
    '{"request_id": "y", "prompt_token_ids": [1]}',  # 6: y
    '{"prompt_token_ids": [1]}',  # line-7
    '{"request_id": "line-7", "prompt_token_ids": [1]}',  # 8: the default id of line 7
    '{"request_id": "\\u00e9", "prompt_token_ids": [1]}',
    '{"request_id": "\u00e9", "prompt_token_ids": [1]}',  # 10: the same id, unescaped
    '{"request_id" :"sp", "prompt_token_ids": [1]}',
    '{"request_id":  "sp", "prompt_token_ids": [1]}',  # 12: other spacing
]


def test_the_counting_pass_finds_every_duplicate_id() -> None:
    """Only ids the pre-pass flags are remembered: it must flag every repeated one."""
    data = "".join(line + "\n" for line in TRICKY_IDS).encode()
    found = scan(io.BytesIO(data), threading.Event())
    assert found is not None and found.total == len(TRICKY_IDS)
    parser = LineParser(found.repeated)
    refused = []
    for number, line in enumerate(data.splitlines(), 1):
        try:
            parser.parse(number, line)
        except BadLine as exc:
            assert "appears twice" in str(exc)
            refused.append(number)
    assert refused == [2, 4, 6, 8, 10, 12]
    assert len(found.repeated) < 10  # the ids flagged, not every id


pytestmark = pytest.mark.anyio


@BACKEND_PAIRS
async def test_results_come_while_stdin_is_still_open(tmp_path: Path, cli_backend: str) -> None:
    """A producer piping requests in sees results before it has written them all."""
    results = tmp_path / "results.jsonl"
    async with cli_process("run", "-", "-o", str(results), "--concurrency", "4",
                           "--no-progress", "--backend", cli_backend) as (process, output):
        assert process.stdin is not None
        await process.stdin.send("".join(line + "\n" for line in lines_for(6)).encode())
        await wait_until(lambda: running(process, output) and complete_lines(results) >= 6,
                         seconds=20)
        await process.stdin.send("".join(line + "\n" for line in lines_for(10)[6:]).encode())
        await process.stdin.aclose()
        with anyio.fail_after(20):
            code = await process.wait()
    assert code == 0, output.err
    assert sorted(line["request_id"] for line in read_results(results)) == [
        f"r{i:03d}" for i in range(10)]
    # No total is known for a stream: the count alone.
    assert output.err.strip().splitlines()[-1].startswith(
        "anyio-genout: 10 done, 0 failed, 0 skipped")


class CountingParser(LineParser):
    """Counts the parsed requests that have no result line yet."""

    def __init__(self) -> None:
        super().__init__(None)
        self.live = 0
        self.most = 0

    def parse(self, number: int, line: bytes) -> GenerateRequest:
        request = super().parse(number, line)
        self.live += 1
        self.most = max(self.most, self.live)
        return request


class Results(io.StringIO):
    def __init__(self, parser: CountingParser) -> None:
        super().__init__()
        self.parser = parser
        self.count = 0

    def write(self, text: str) -> int:
        self.parser.live -= 1
        self.count += 1
        return len(text)


async def test_the_reader_holds_no_more_requests_than_are_in_flight() -> None:
    """Memory is bounded by --concurrency: at most one parsed request waits for a worker."""
    address = free_tcp_address()
    data = "".join(line + "\n" for line in lines_for(600, max_tokens=1)).encode()
    parser = CountingParser()
    out = Results(parser)
    job = Job(enabled=False)
    async with anyio.create_task_group() as tg:
        tg.start_soon(MockEngine(MockEngineConfig(handshake_address=address, linger=0.0,
                                                  keep_history=False)).serve)
        config = ClientConfig(engine=EngineCoreClientConfig(transport=HandshakeTransport(address),
                                                            ready_timeout=20))
        async with Client.connect(config) as client:
            with anyio.fail_after(30):
                await run_all(client, LineReader(io.BytesIO(data), chunk=4096), parser, None,
                              8, out, job)
        tg.cancel_scope.cancel()
    assert out.count == job.done == 600
    assert parser.most <= 8 + 1, parser.most
