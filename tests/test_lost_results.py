"""Nothing finished is lost: a single run stopped by SIGINT/SIGTERM at a random moment keeps every
request it reported finished (summary.json marked partial); a file-size limit keeps the primary
results, written first, and says so in one line."""

import json
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

from tests.paths import ROOT

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


def no_temporaries(directory) -> None:
    assert not [p for p in directory.rglob("*") if p.name.endswith(".tmp")]


@pytest.mark.parametrize("seed,signum,mode", [(0, signal.SIGTERM, "chunked"), (1, signal.SIGTERM, "chunked"),
                                              (2, signal.SIGINT, "chunked"), (3, signal.SIGTERM, "disagg")])
def test_a_single_run_stopped_at_a_random_moment_keeps_every_finished_request(tmp_path, seed, signum, mode):
    delay_s = random.Random(seed).uniform(0.0, 3.0)  # after the first finished request: where the signal lands
    args = RUN if mode != "disagg" else [*RUN, "mode=disagg", "cluster.num_prefill=1", "cluster.num_decode=1"]
    proc = subprocess.Popen([sys.executable, "-m", "testbed", *args, f"hydra.run.dir={tmp_path}"], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    progress = Progress(proc.stderr)
    try:
        progress.wait_for(proc, 1)
        time.sleep(delay_s)
        reported = progress.finished  # read before the signal: each was in the request log by then
        proc.send_signal(signum)
        code = proc.wait(timeout=HANG_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    stderr = progress.close()
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
    note = stderr.split("interrupted: ")[-1]
    assert f"{ok} of 300 requests finished" in note and "does not resume" in note and "rerun" not in note
    no_temporaries(tmp_path)


def limit_file_size(limit: int):
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


def test_a_file_size_limit_keeps_the_primary_results_and_is_one_line(tmp_path):
    """The limit lets requests.parquet and summary.json through but not every other file: they are
    written first, whole, and the run ends with one line and a non-zero exit."""
    command = [sys.executable, "-m", "testbed", "executor=sim", "workload.num_requests=200"]
    whole = subprocess.run([*command, f"hydra.run.dir={tmp_path / 'whole'}"], cwd=ROOT, capture_output=True,
                           text=True, timeout=HANG_S)
    assert whole.returncode == 0, whole.stderr[-2000:]
    sizes = {p.relative_to(tmp_path / "whole").as_posix(): p.stat().st_size
             for p in (tmp_path / "whole").rglob("*") if p.is_file()}
    limit = max(sizes["requests.parquet"], sizes["summary.json"]) + 4096
    assert limit < max(sizes.values())  # the limit stops some file
    out = tmp_path / "limited"
    run = subprocess.run([*command, f"hydra.run.dir={out}"], cwd=ROOT, capture_output=True, text=True,
                         timeout=HANG_S, preexec_fn=limit_file_size(limit))
    assert run.returncode != 0 and "Traceback" not in run.stderr, run.stderr[-3000:]
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "File too large" in errors[0], run.stderr[-3000:]
    kept = pd.read_parquet(out / "requests.parquet")
    assert kept.equals(pd.read_parquet(tmp_path / "whole" / "requests.parquet"))
    assert json.loads((out / "summary.json").read_text())["num_requests"] == \
        json.loads((tmp_path / "whole" / "summary.json").read_text())["num_requests"]
    no_temporaries(out)


def test_a_failed_export_names_the_results_it_kept(tmp_path, monkeypatch):
    """The exports come last: one that fails leaves the results contract written and says so."""
    from testbed.metrics.events import request_table
    from testbed.metrics.results_dir import ResultsError, read_results
    from testbed.studies import points
    from tests.cluster_helpers import make_config

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(points, "export_run", full_disk)
    with pytest.raises(ResultsError, match=r"No space left on device; the results .* are written in .*, its exports"):
        points.write_files(make_config(), tmp_path, requests=request_table([{"request_id": 0}]),
                           summary={"num_requests": {"ok": 1}}, prompts=None, meta={})
    assert len(read_results(tmp_path)["requests"]) == 1
