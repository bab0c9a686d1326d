"""Nothing finished is lost: a single run stopped by SIGINT/SIGTERM at a random moment keeps every
request it reported finished (summary.json marked partial), a real run's and a replay against a
server's alike; a stopped simulation says truthfully what it kept; a file-size limit keeps the
primary results, written first, and says so in one line. Refusals of every port are in
summary.json's `refused`; a failed point's error.txt on a full disk is a warning, not a traceback."""

import asyncio
import json
import os
import random
import re
import resource
import signal
import subprocess
import sys
import threading
import time

import pandas as pd
import pytest
from aiohttp import web

from tests.paths import ROOT, error_lines
from tests.stub_server import served

pytestmark = pytest.mark.slow

# the tiny model on one CPU worker: ~5 requests/s, so 300 requests outlast any delay below
RUN = ["hardware=cpu", "cluster.num_workers=1", "workload.num_requests=300"]
HANG_S = 600  # a guard against a hang, not a pace: a loaded two-core machine may be slow
PROGRESS = re.compile(r" (\d+)/\d+ \[")  # tqdm's "N/total [" on stderr: what the run reports finished


class Progress:
    """stderr read on a thread; `finished` is the last count the run's progress bar showed."""

    def __init__(self, stream):
        self.text, self.finished = "", 0
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:
        for chunk in iter(lambda: stream.read1(4096), b""):
            self.text += chunk.decode(errors="replace")
            counts = PROGRESS.findall(self.text[-400:])
            if counts:
                self.finished = int(counts[-1])

    def wait_for(self, proc, finished: int) -> None:
        deadline = time.monotonic() + HANG_S
        while self.finished < finished:
            assert proc.poll() is None, self.text[-3000:]
            assert time.monotonic() < deadline, "no request finished"
            time.sleep(0.1)

    def close(self) -> str:
        self._thread.join(timeout=60)
        return self.text


def stopped(command: list[str], delay_s: float, signum) -> tuple[int, str, int]:
    """Run `command`, signal it `delay_s` after its first finished request: (exit code, stderr,
    requests it had reported finished before the signal)."""
    proc = subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
    )
    progress = Progress(proc.stderr)
    try:
        progress.wait_for(proc, 1)
        time.sleep(delay_s)  # where the signal lands (the wait above is on an event, not a pace)
        reported = progress.finished  # read before the signal: each was in the request log by then
        proc.send_signal(signum)
        code = proc.wait(timeout=HANG_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    return code, progress.close(), reported


def no_temporaries(directory) -> None:
    assert not [p for p in directory.rglob("*") if p.name.endswith(".tmp")]


@pytest.mark.parametrize(
    "seed,signum,mode",
    [
        (0, signal.SIGTERM, "chunked"),
        (1, signal.SIGTERM, "chunked"),
        (2, signal.SIGINT, "chunked"),
        (3, signal.SIGTERM, "disagg"),
    ],
)
def test_a_single_run_stopped_at_a_random_moment_keeps_every_finished_request(tmp_path, seed, signum, mode):
    delay_s = random.Random(seed).uniform(0.0, 3.0)  # after the first finished request: where the signal lands
    # disagg: requests that outlast the signal on D (at the default rate and lengths none is open by
    # then, and a decode worker never told of the cut ones kept their KV: issue 43)
    args = (
        RUN
        if mode != "disagg"
        else [
            *RUN,
            "mode=disagg",
            "cluster.num_prefill=1",
            "cluster.num_decode=1",
            "workload.rate=40",
            "workload.output_len.min=100",
            "workload.output_len.max=200",
        ]
    )
    code, stderr, reported = stopped(
        [sys.executable, "-m", "testbed", *args, f"hydra.run.dir={tmp_path}"], delay_s, signum
    )
    assert code == 130 and "Traceback" not in stderr, stderr[-3000:]
    requests = pd.read_parquet(tmp_path / "requests.parquet")
    summary = json.loads((tmp_path / "summary.json").read_text())
    ok = int((requests.status == "ok").sum())
    assert ok >= reported >= 1
    assert set(requests.loc[requests.status != "ok", "reason"]) <= {"interrupted"}  # only the ones cut short
    cut = summary["interrupted"]
    assert summary["partial"] is True and summary["num_requests"]["ok"] == ok
    assert ok + cut["requests_cut"] + cut["requests_not_sent"] == cut["requests_planned"] == 300
    assert not any(summary["kv_blocks_leaked"].values())  # the cut requests' KV was freed
    assert mode != "disagg" or cut["requests_cut"] >= 1  # some were on D when the signal came
    note = stderr.split("interrupted: ")[-1]
    assert f"{ok} of 300 requests finished" in note and "does not resume" in note and "rerun" not in note
    no_temporaries(tmp_path)


def limit_file_size(limit: int):
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


def test_a_file_size_limit_keeps_the_primary_results_and_is_one_line(tmp_path):
    """The limit lets requests.parquet and summary.json through but not every other file: they are
    written first, whole, and the run ends with one line and a non-zero exit."""
    command = [sys.executable, "-m", "testbed", "executor=sim", "workload.num_requests=200"]
    whole = subprocess.run(
        [*command, f"hydra.run.dir={tmp_path / 'whole'}"], cwd=ROOT, capture_output=True, text=True, timeout=HANG_S
    )
    assert whole.returncode == 0, whole.stderr[-2000:]
    sizes = {
        p.relative_to(tmp_path / "whole").as_posix(): p.stat().st_size
        for p in (tmp_path / "whole").rglob("*")
        if p.is_file()
    }
    limit = max(sizes["requests.parquet"], sizes["summary.json"]) + 4096
    assert limit < max(sizes.values())  # the limit stops some file
    out = tmp_path / "limited"
    run = subprocess.run(
        [*command, f"hydra.run.dir={out}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=HANG_S,
        preexec_fn=limit_file_size(limit),
    )
    assert run.returncode != 0 and "Traceback" not in run.stderr, run.stderr[-3000:]
    errors = error_lines(run.stderr)
    assert len(errors) == 1 and "File too large" in errors[0], run.stderr[-3000:]
    kept = pd.read_parquet(out / "requests.parquet")
    assert kept.equals(pd.read_parquet(tmp_path / "whole" / "requests.parquet"))
    assert (
        json.loads((out / "summary.json").read_text())["num_requests"]
        == json.loads((tmp_path / "whole" / "summary.json").read_text())["num_requests"]
    )
    no_temporaries(out)


def test_a_failed_export_names_the_results_it_kept(tmp_path, monkeypatch):
    """The exports come last: one that fails leaves the results contract written and says so."""
    from testbed.metrics.events import request_table
    from testbed.metrics.results_dir import ResultsError, read_results
    from testbed.studies import executors
    from tests.cluster_helpers import make_config

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(executors, "export_run", full_disk)
    with pytest.raises(ResultsError, match=r"No space left on device; the results .* are written in .*, its exports"):
        executors.write_files(
            make_config(),
            tmp_path,
            requests=request_table([{"request_id": 0}]),
            summary={"num_requests": {"ok": 1}},
            prompts=None,
            meta={},
        )
    assert len(read_results(tmp_path)["requests"]) == 1


# -- executor=http: a long load test stopped at a random moment --------------------------------------
class SlowServer:
    """An OpenAI-compatible stub that streams each request's max_tokens tokens one per TOKEN_S, so
    a replay lasts long enough to be stopped mid-way; `done` counts the streams it ended with [DONE]."""

    TOKEN_S = 0.05

    def __init__(self):
        self.done = 0

    async def models(self, request):
        return web.json_response({"data": [{"id": "m", "max_model_len": 256}]})

    async def completions(self, request):
        body = await request.json()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            for i in range(body["max_tokens"]):
                await asyncio.sleep(self.TOKEN_S)
                await response.write(b'data: {"choices":[{"text":" x","token_ids":[%d]}]}\n\n' % i)
            await response.write(b"data: [DONE]\n\n")
            self.done += 1
            await response.write_eof()
        except ConnectionResetError:  # the client cut it (stopped): nothing more to send
            pass
        return response


@pytest.fixture
def slow_server():
    """(the stub, its URL)."""
    handlers = SlowServer()
    with served(handlers) as url:
        yield handlers, url


# 200 requests at 10/s, each 6-20 tokens at 20 tokens/s: ~20 s of replay, so every delay below lands mid-way
HTTP_RUN = [
    "executor=http",
    "workload.num_requests=200",
    "workload.rate=10",
    "workload.input_len.min=20",
    "workload.input_len.max=120",
    "workload.output_len.min=6",
    "workload.output_len.max=20",
    "model.max_model_len=256",
]


@pytest.mark.parametrize("seed,signum", [(0, signal.SIGTERM), (1, signal.SIGINT), (2, signal.SIGTERM)])
def test_an_http_run_stopped_at_a_random_moment_keeps_every_finished_request(tmp_path, slow_server, seed, signum):
    server, url = slow_server
    delay_s = random.Random(seed).uniform(0.0, 3.0)  # after the first finished request: where the signal lands
    command = [sys.executable, "-m", "testbed", *HTTP_RUN, f"http.url={url}", f"hydra.run.dir={tmp_path}"]
    code, stderr, reported = stopped(command, delay_s, signum)
    assert code == 130 and "Traceback" not in stderr, stderr[-3000:]
    requests = pd.read_parquet(tmp_path / "requests.parquet")
    summary = json.loads((tmp_path / "summary.json").read_text())
    ok = requests[requests.status == "ok"]
    assert server.done >= len(ok) >= reported >= 1  # every request it said finished is on disk, and ended
    assert (ok.token_times.map(len) == ok.output_len).all()  # whole: every token of each
    assert set(requests.loc[requests.status != "ok", "reason"]) <= {"interrupted"}  # only the ones cut short
    cut = summary["interrupted"]
    assert summary["partial"] is True and summary["num_requests"]["ok"] == len(ok)
    assert len(ok) + cut["requests_cut"] + cut["requests_not_sent"] == cut["requests_planned"] == 200
    assert len(requests) == len(ok) + cut["requests_cut"]  # the cut ones recorded, the unsent ones counted
    note = stderr.split("interrupted: ")[-1]
    assert f"{len(ok)} of 200 requests finished" in note and "does not resume" in note and "rerun" not in note
    no_temporaries(tmp_path)


# -- executor=sim: nothing partial, and said so ------------------------------------------------------
SIM_RUN = ["executor=sim", "workload.num_requests=10000"]  # here a 2 s loop, then 0.5 s of writing


def appeared(path, proc) -> None:
    """Wait, polled, until `path` exists (an event of the run), failing if the run ends first."""
    deadline = time.monotonic() + HANG_S
    while not path.exists():
        assert proc.poll() is None, "the run ended first"
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.01)


@pytest.mark.parametrize("moment", ["in its loop", "while written"])
def test_a_simulation_stopped_at_a_random_moment_says_what_it_kept(tmp_path, moment):
    """Stopped in its loop a simulation keeps nothing and says so; stopped once its files are being
    written, it writes them whole and says they are complete. Either way the line is true. The
    moments are the run's own events: its .hydra/ made (then half a second: into the loop), its
    config.yaml written (the first of its files)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "testbed", *SIM_RUN, f"hydra.run.dir={tmp_path}"],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        if moment == "while written":
            appeared(tmp_path / "config.yaml", proc)
        else:
            appeared(tmp_path / ".hydra", proc)
            time.sleep(0.5)  # where the signal lands (the wait above is on an event, not a pace)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=HANG_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    if proc.returncode == 0:  # it had ended before the signal (a fast machine)
        return
    assert proc.returncode == 130 and "Traceback" not in stderr, stderr[-3000:]
    note = stderr.split("interrupted: ")[-1]
    if "nothing kept" in note:
        assert not (tmp_path / "summary.json").exists() and not (tmp_path / "requests.parquet").exists()
    else:
        assert "results are complete" in note, note
        assert len(pd.read_parquet(tmp_path / "requests.parquet")) == 10000
        assert "partial" not in json.loads((tmp_path / "summary.json").read_text())
    no_temporaries(tmp_path)


def test_a_simulation_stopped_in_its_loop_keeps_nothing_and_says_so(tmp_path, monkeypatch):
    from testbed.stopping import Stopped
    from testbed.studies import executors
    from tests.cluster_helpers import make_config

    def stopped(serving, sim):
        raise KeyboardInterrupt

    monkeypatch.setattr(executors, "simulate", stopped)
    with pytest.raises(Stopped, match="nothing kept") as caught:
        executors.simulate_point(make_config("executor=sim", "workload.num_requests=5"), tmp_path)
    assert "no partial results" in caught.value.note and not list(tmp_path.iterdir())


@pytest.fixture
def stop_once():
    """This process's SIGINT/SIGTERM handled as the command line does, put back afterwards."""
    from testbed import stopping

    before = {signum: signal.getsignal(signum) for signum in stopping.SIGNALS}
    yield stopping.StopOnce().install()
    for signum, handler in before.items():
        signal.signal(signum, handler)
    stopping._installed = None


def test_a_signal_while_a_simulation_is_written_waits_for_its_files(tmp_path, monkeypatch, stop_once):
    from testbed.stopping import Stopped
    from testbed.studies import executors
    from tests.cluster_helpers import make_config

    export = executors.export_run

    def signalled(*args, **kwargs):  # the signal lands between the results and the exports
        os.kill(os.getpid(), signal.SIGTERM)
        return export(*args, **kwargs)

    monkeypatch.setattr(executors, "export_run", signalled)
    with pytest.raises(Stopped, match="results are complete"):
        executors.simulate_point(make_config("executor=sim", "workload.num_requests=5"), tmp_path)
    assert stop_once.requested.is_set()
    assert len(pd.read_parquet(tmp_path / "requests.parquet")) == 5 and (tmp_path / "exports").is_dir()
    assert "partial" not in json.loads((tmp_path / "summary.json").read_text())


# -- refusals of every port in summary.json ---------------------------------------------------------
def test_refusals_count_every_port_in_one_place():
    from testbed.studies.executors import refusals

    messages = {
        "0": {"driver": {"not JSON": 2}, "router": {"not a ZeroMQ peer": 1}, "worker0": {"too deep": 1}},
        "1": {"rank1": {"authentication failed": 3}, "worker1": {"oversized": 1}},
        "2": {"unknown": {"the rank did not report": 1}},
    }
    assert refusals({"503": 1, "429": 4}, messages) == {
        "http": {"429": 4, "503": 1},
        "agent": 3,
        "driver": 2,
        "router": 1,
        "worker": 2,
        "total": 13,
        "unreported_ranks": [2],
    }
    assert refusals() == {"http": {}, "agent": 0, "driver": 0, "router": 0, "worker": 0, "total": 0}


# -- a failed sweep point on a full disk ----------------------------------------------------------------
def test_a_failed_point_whose_error_file_cannot_be_written_is_one_warning(tmp_path, caplog):
    from testbed.studies.sweep import Point, Sweep
    from tests.cluster_helpers import make_config

    def full_disk(cfg, directory):
        raise OSError(28, "No space left on device")

    (tmp_path / "points").write_text("")  # a file where the point's directory would go: error.txt cannot be
    cfg = make_config()
    sweep = Sweep(cfg, [Point("p", {}, {})], tmp_path, full_disk, tracker=None)
    row = sweep._run_one(sweep.points[0], cfg)
    assert row["status"] == "failed" and "No space left" in row["error"]
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "error.txt" in warnings[0] and "\n" not in warnings[0]
