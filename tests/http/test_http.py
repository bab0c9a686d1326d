"""executor=http and the OpenAI-compatible server: the protocol's checks, the server's answers to
bad input and to clients that go away (with the KV audit), the executor against the server and
against servers that fail, stall or break their streams."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
from aiohttp import web

from testbed.errors import ConfigError
from testbed.http.protocol import BadRequest, parse_completion, read_event
from testbed.server.app import HttpServer
from testbed.studies.executors import http_point
from tests.cluster_helpers import make_config, small_workload
from tests.stub_server import served

LIMITS = {"vocab_size": 100, "max_model_len": 64, "model": "testbed"}


def parse(body) -> object:
    return parse_completion(json.dumps(body).encode() if not isinstance(body, bytes) else body, **LIMITS)


# -- the protocol --------------------------------------------------------------------------------
def test_a_well_formed_request_is_read_with_defaults():
    spec = parse(
        {
            "model": "testbed",
            "prompt": [1, 2, 3],
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": 0.0,
            "ignore_eos": True,
            "min_tokens": 4,
            "max_tokens": 4,
        }
    )
    assert (spec.prompt_token_ids, spec.max_tokens, spec.stream, spec.include_usage) == ((1, 2, 3), 4, True, True)
    assert parse({"prompt": [[5, 6]]}).max_tokens == 16  # a batch of one; OpenAI's default length


@pytest.mark.parametrize(
    "body, says",
    [
        (b"{not json", "not valid JSON"),
        ([1, 2], "JSON object"),
        ({"prompt": [1], "colour": "red"}, "unknown field(s) colour"),
        ({"prompt": [1], "\n": None}, 'unknown field(s) "\\n"'),  # found by the fuzz run: a name is shown escaped
        ({"prompt": [1] * 64}, "the prompt has 64 tokens"),
        ({"prompt": [1] * 10, "max_tokens": 55}, "max_tokens=55 is out of range; allowed: 1..54"),
        ({"prompt": [1], "max_tokens": 0}, "max_tokens=0"),
        ({"prompt": [1], "max_tokens": True}, "max_tokens=true"),
        ({"prompt": [1], "temperature": 0.7}, "temperature=0.7 is not supported"),
        ({"prompt": [1], "n": 2}, "n=2"),
        ({"prompt": [[1], [2]]}, "batches of several prompts"),
        ({"prompt": "hello"}, "no tokenizer"),
        ({"prompt": [1, 100]}, "[0, 100)"),
        ({"prompt": [1], "stream": "yes"}, "stream must be true or false"),
        ({"prompt": [1], "min_tokens": 40, "max_tokens": 8}, "min_tokens=40"),
        (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nests 100001 levels deep; the limit is 8"),
        ({"prompt": [[[1]]]}, "integers in [0, 100)"),
        (b'{"prompt": [1], "user": "' + b"[" * 5000 + b'", "n": 2}', "n=2"),  # brackets in a string do not nest
    ],
)
def test_a_bad_request_is_one_line_naming_the_field(body, says):
    with pytest.raises(BadRequest) as refused:
        parse(body)
    assert says in str(refused.value) and "\n" not in str(refused.value) and refused.value.status == 400


def test_a_long_prompt_is_refused_by_its_length_before_its_ids_are_read():
    with pytest.raises(BadRequest, match="the prompt has 100000 tokens"):
        parse({"prompt": [None] * 100_000})


def test_a_body_over_the_limit_is_refused_with_413():
    with pytest.raises(BadRequest, match="the limit is") as refused:
        parse(b" " * (2 << 20) + b"{}")
    assert refused.value.status == 413


def test_another_model_is_not_found():
    with pytest.raises(BadRequest) as refused:
        parse({"prompt": [1], "model": "llama"})
    assert refused.value.status == 404


def test_stream_lines_read_as_tokens_usage_errors_and_the_end():
    line = b'data: {"choices":[{"text":" 5 6","token_ids":[5,6]}]}'
    assert (read_event(line).count, read_event(line).token_ids) == (2, [5, 6])
    assert read_event(b'data: {"choices":[{"text":"hi"}]}').count == 1  # no ids: one token per chunk with text
    assert read_event(b'data: {"choices":[],"usage":{"completion_tokens":7}}').usage_tokens == 7
    assert read_event(b'data: {"error":{"message":"boom"}}').error == "boom"
    assert read_event(b"data: [DONE]").done
    assert read_event(b"") is None and read_event(b": keep-alive") is None


def test_an_open_interface_needs_an_api_key_and_the_client_needs_a_url(tmp_path):
    with pytest.raises(ConfigError, match="http.api_key"):
        HttpServer(make_config("http.host=0.0.0.0"))
    with pytest.raises(ConfigError, match="http.url"):
        http_point(make_config("executor=http"), tmp_path)
    with pytest.raises(ConfigError, match="http.prompt"):
        make_config("http.prompt=words")


# -- the server ----------------------------------------------------------------------------------
def post(url: str, body, key: str | None = None) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url + "/v1/completions", data=data, headers={"Content-Type": "application/json"})
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def health(url: str) -> dict:
    with urllib.request.urlopen(url + "/health", timeout=60) as response:
        return json.loads(response.read())


def open_stream(url: str, prompt: list[int], max_tokens: int) -> socket.socket:
    """A raw streaming request whose socket the test can drop mid-stream."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "stream": True}).encode()
    sock = socket.create_connection((host, int(port)), timeout=120)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    return sock


def raw_status(url: str, head: bytes, body: bytes = b"") -> int:
    """The status line's code for a request sent byte for byte (headers a urllib client would not send)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=120) as sock:
        sock.sendall(head + b"\r\n\r\n" + body)
        answer = read_until(sock, b"\r\n")
    return int(answer.split(b" ")[1])


def read_until(sock: socket.socket, marker: bytes, count: int = 1) -> bytes:
    data = b""
    while data.count(marker) < count:
        part = sock.recv(65536)
        if not part:
            break
        data += part
    return data


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    out = tmp_path_factory.mktemp("server")
    cfg = make_config(*small_workload(), "http.port=0", "http.max_streams=2", "cluster.num_workers=1")
    with HttpServer(cfg, out) as running:
        yield running


def test_the_server_answers_bad_input_with_4xx_and_keeps_serving(server):
    status, body = post(server.url, b"{oops")
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    status, body = post(server.url, {"prompt": [1], "logprobs": 3})
    assert status == 400 and "logprobs" in body["error"]["message"]
    status, body = post(server.url, {"prompt": [1] * 300})
    assert status == 400 and "max_model_len 256" in body["error"]["message"]
    status, body = post(server.url, {"prompt": [1, 2, 3], "max_tokens": 1000})
    assert status == 400 and "max_tokens=1000" in body["error"]["message"]
    status, body = post(server.url, {"prompt": [1, 2, 3], "max_tokens": 5, "return_token_ids": True})
    assert status == 200 and len(body["choices"][0]["token_ids"]) == 5 and body["usage"]["completion_tokens"] == 5
    status, body = post(server.url, b'{"prompt": ' + b"[" * 50_000 + b"]" * 50_000 + b"}")
    assert status == 400 and "nests" in body["error"]["message"]
    assert health(server.url)["status"] == "ok"


def test_a_body_over_the_limit_is_refused_before_or_while_reading(server):
    post_head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
    # the length announced is refused before a byte of the body is sent
    assert raw_status(server.url, post_head + b"\r\nContent-Length: 1000000000") == 413
    # a chunked body (no length announced) is cut off once it is over the limit
    piece = b" " * (1 << 20)
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for _ in range(3)) + b"0\r\n\r\n"
    assert raw_status(server.url, post_head + b"\r\nTransfer-Encoding: chunked", chunks) == 413
    assert health(server.url)["status"] == "ok"


def test_a_large_body_is_parsed_off_the_event_loop(server, monkeypatch):
    import testbed.server.app as http_server

    threads = []

    def recording(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return parse_completion(*args, **kwargs)

    monkeypatch.setattr(http_server, "parse_completion", recording)
    status, _ = post(server.url, b'{"prompt": [1, 2], "max_tokens": 2' + b" " * (200 << 10) + b"}")
    assert status == 200 and threads and threads[0] != "testbed-http"
    status, _ = post(server.url, {"prompt": [1, 2], "max_tokens": 2})  # a small one: parsed in place
    assert status == 200 and threads[1] == "testbed-http"


def test_too_many_streams_get_429_and_dropped_clients_leave_no_kv(tmp_path):
    """Two streams long enough (2000 tokens) that the drops land mid-stream on a loaded machine too; a
    stream whose end the engine reached but whose client left first is still recorded as dropped."""
    cfg = make_config(
        *small_workload(),
        "http.port=0",
        "http.max_streams=2",
        "cluster.num_workers=1",
        "model.max_model_len=2048",
        "engine.num_kv_blocks=512",
    )
    with HttpServer(cfg, tmp_path) as running:
        first, second = (open_stream(running.url, [7] * 30, LONG) for _ in range(2))
        try:
            read_until(first, b"data:", 2)  # both are streaming: the server holds two open requests
            read_until(second, b"data:", 2)
            status, body = post(running.url, {"prompt": [1, 2], "max_tokens": 2})
            assert status == 429 and "http.max_streams=2" in body["error"]["message"]
        finally:
            first.close()
            second.close()
        deadline = time.monotonic() + 120  # polled: the aborts reach the workers on a loaded machine too
        while health(running.url)["active_requests"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert health(running.url)["active_requests"] == 0
        status, _ = post(running.url, {"prompt": [1, 2], "max_tokens": 2})
        assert status == 200
    summary, requests = running.result["summary"], running.result["requests"]
    assert all(v == 0 for v in summary["kv_blocks_leaked"].values())  # the workers' own audit at exit
    assert summary["refused"]["http"] == {"429": 1} and summary["refused"]["total"] == 1
    dropped = requests[requests.reason == "client disconnected"]
    assert len(dropped) == 2 and (dropped.token_times.map(len) < LONG).all(), requests[["status", "reason"]]
    assert (requests.status == "ok").sum() == 1


LONG = 2000


def test_an_api_key_is_required_when_set(tmp_path):
    cfg = make_config(*small_workload(), "http.port=0", "http.api_key=sesame", "cluster.num_workers=1")
    with HttpServer(cfg) as running:
        status, body = post(running.url, {"prompt": [1, 2], "max_tokens": 2})
        assert status == 401 and "API key" in body["error"]["message"]
        body = json.dumps({"prompt": [1, 2], "max_tokens": 2}).encode()
        head = (
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer \xff\xfe\xc3(sesame\r\nContent-Length: %d" % len(body)
        )
        assert raw_status(running.url, head, body) == 401  # a header that is not UTF-8: no key, not a 500
        assert post(running.url, {"prompt": [1, 2], "max_tokens": 2}, key="sesame")[0] == 200


# -- the executor against the project's server ----------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize(
    "serving",
    [["mode=disagg", "cluster.num_prefill=1", "cluster.num_decode=1"], ["mode=chunked", "cluster.num_workers=1"]],
    ids=["1P1D", "chunked"],
)
def test_executor_http_gives_the_in_process_runs_tokens(serving, tmp_path):
    from testbed.studies.real_cluster import serve

    workload = [*small_workload(8, 10.0), "workload.turns=2", "workload.think_time_s=0.05"]
    reference = serve(
        make_config(*workload, "mode=colocated", "cluster.num_workers=1"), tmp_path / "ref", progress=False
    )
    cfg = make_config(*workload, *serving, "http.port=0")
    with HttpServer(cfg, tmp_path / "server") as running:
        client = make_config(*workload, "executor=http", f"http.url={running.url}")
        result = http_point(client, tmp_path / "client", progress=False)
    ours, theirs = result["requests"], reference["requests"]
    assert (ours.status == "ok").all() and len(ours) == len(theirs) > 8  # later turns came back
    assert ours.output_token_ids.map(list).tolist() == theirs.output_token_ids.map(list).tolist()
    assert (ours.input_len.values == theirs.input_len.values).all()
    assert all(v == 0 for v in running.result["summary"]["kv_blocks_leaked"].values())


# -- the executor against servers that fail ------------------------------------------------------
class Misbehaving:
    """/v1/completions answers request k by BEHAVIOURS[k % 5]: a good stream, an HTTP error, a
    stream that goes silent, one that breaks off without [DONE], one that reports an error."""

    BEHAVIOURS = ("good", "error", "stall", "cut", "error_chunk")

    def __init__(self):
        self.count = 0

    async def models(self, request):
        return web.json_response({"data": [{"id": "m", "max_model_len": 256}]})

    async def completions(self, request):
        body = await request.json()
        behaviour = self.BEHAVIOURS[self.count % len(self.BEHAVIOURS)]
        self.count += 1
        if behaviour == "error":
            return web.json_response({"error": {"message": "the engine fell over"}}, status=500)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        n = body["max_tokens"] if behaviour == "good" else 2
        for i in range(n):
            await response.write(b'data: {"choices":[{"text":" x","token_ids":[%d]}]}\n\n' % i)
        if behaviour == "stall":
            await asyncio.Event().wait()  # silent until the client gives up
        if behaviour == "error_chunk":
            await response.write(b'data: {"error":{"message":"out of KV blocks"}}\n\n')
        if behaviour != "cut":
            await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


@pytest.fixture
def misbehaving():
    with served(Misbehaving()) as url:
        yield url


def test_failures_are_recorded_per_request_and_the_run_ends(misbehaving, tmp_path):
    cfg = make_config(
        *small_workload(10, 50.0),
        "executor=http",
        f"http.url={misbehaving}",
        "http.stall_timeout_s=0.5",
        "http.max_concurrency=4",
    )
    result = http_point(cfg, tmp_path, progress=False)
    table = result["requests"].sort_values("request_id")
    reasons = dict(zip(table.request_id, table.reason))
    # which request met which behaviour depends on the order of sending: the reasons are a multiset
    kinds = sorted(r.split(":")[0].split(" ")[0] for r in reasons.values() if r)
    assert kinds == sorted(["http"] * 2 + ["no"] * 2 + ["the"] * 2 + ["out"] * 2)
    assert (table.status == "ok").sum() == 2 and (table.status == "failed").sum() == 8
    assert result["summary"]["http"]["errors"]["http 500"] == 2
    assert result["summary"]["http"]["refused"] == {"500": 2}  # answered with an HTTP error, by status
    on_disk = json.loads((tmp_path / "summary.json").read_text())["refused"]  # every port's, in one place
    assert on_disk == {"http": {"500": 2}, "agent": 0, "driver": 0, "router": 0, "worker": 0, "total": 2}
    assert result["summary"]["num_requests"]["failed"] == 8
    stalled = table[table.reason.str.startswith("no chunk")]
    assert stalled.token_times.map(len).tolist() == [2, 2]  # tokens that came before the silence are kept
    assert (tmp_path / "summary.json").is_file() and (tmp_path / "requests.parquet").is_file()


def test_an_unreachable_server_is_one_line_before_any_request(tmp_path):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    with pytest.raises(ConfigError, match="GET /v1/models failed"):
        http_point(make_config(*small_workload(2), "executor=http", f"http.url={url}"), tmp_path)
    sock.close()


# -- the command line ------------------------------------------------------------------------------
@pytest.mark.slow
def test_serve_http_serves_a_study_and_stops_cleanly_on_sigterm(tmp_path):
    """`python -m testbed.serve_http` in its own process group: a rate_sweep replays against it
    (its figures drawn from the same tables as a built-in run), then SIGTERM stops it with the
    server's results written and no worker left behind."""
    import signal
    import subprocess
    import sys

    from tests.paths import ROOT
    from tests.study_runs import run_study

    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "testbed.serve_http",
            f"hydra.run.dir={tmp_path / 'server'}",
            "http.port=0",
            "hardware=cpu",
            "cluster.num_workers=1",
            "model.max_model_len=512",
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        line = server.stdout.readline()
        assert " on http://" in line, line + server.stderr.read()
        url = line.split(" on ")[1].split("/v1/")[0]
        result = run_study(
            "rate_sweep",
            tmp_path / "sweep",
            "executor=http",
            f"http.url={url}",
            "model=tiny",
            "experiment.figures=true",
            "workload.input_len.min=20",
            "workload.input_len.max=200",
            "workload.output_len.min=4",
            "workload.output_len.max=32",
            "http.label=served",
        )
        table = result["table"]
        assert table.label.tolist() == ["served", "served"] and (table.status == "ok").all()
        assert (table.num_requests_ok == 6).all() and result["figures"]
    finally:
        server.send_signal(signal.SIGTERM)
        code = server.wait(timeout=300)
    assert code == 0, server.stderr.read()
    summary = json.loads((tmp_path / "server" / "summary.json").read_text())
    assert summary["num_requests"]["ok"] == 12 and not any(summary["kv_blocks_leaked"].values())
    # the session held the server, its workers and multiprocessing's resource tracker, which exits
    # when it sees the server's end of its pipe close: given time on a loaded machine, none is left
    deadline = time.monotonic() + 60
    while live_in_group(server.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert live_in_group(server.pid) == []


def live_in_group(pgid: int) -> list[int]:
    """Processes of a process group that still run (zombies, reaped by nobody here, do not)."""
    from pathlib import Path

    live = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone while listing
        if int(fields[2]) == pgid and fields[0] != "Z":
            live.append(int(stat.parent.name))
    return live


@pytest.mark.slow
def test_text_prompts_reach_the_server_at_the_lengths_recorded(tmp_path):
    """http.prompt=text: the client decodes each prompt with the tokenizer, and what the server
    reads back (by the same tokenizer) is the length the client's table records."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(100)} | {"[UNK]": 100}, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]").save_pretrained(tmp_path / "tok")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "tok")
    cfg = make_config(*small_workload(6), "http.port=0", "cluster.num_workers=1")
    with HttpServer(
        cfg,
        tmp_path / "server",
        text=tokenizer.decode,
        encode=lambda text: tokenizer.encode(text, add_special_tokens=False),
    ) as running:
        client = make_config(
            *small_workload(6),
            "executor=http",
            f"http.url={running.url}",
            "http.prompt=text",
            f"http.tokenizer={tmp_path / 'tok'}",
        )
        ours = http_point(client, tmp_path / "client", progress=False)["requests"]
    served = running.result["requests"]
    assert (ours.status == "ok").all() and len(ours) == 6
    assert sorted(ours.input_len) == sorted(served.input_len)
    assert sorted(ours.output_token_ids.map(list).tolist()) == sorted(served.output_token_ids.map(list).tolist())
