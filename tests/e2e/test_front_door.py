"""What a newcomer meets first: an unreachable server is one line and a non-zero exit whatever
is set, a real checkpoint runs from the command line with default options."""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import urllib.request

import pytest

from tests.paths import ROOT


def refusing_url():
    """A port bound but never listening (connections are refused), held while the test runs."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock, f"http://127.0.0.1:{sock.getsockname()[1]}"


def run_testbed(*args, tmp_path, module="testbed", timeout=300):
    return subprocess.run(
        [sys.executable, "-m", module, f"hydra.run.dir={tmp_path}", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.parametrize(
    "study", [[], ["+experiment=rate_sweep", "experiment.rates=[1,2]"]], ids=["serve", "rate_sweep"]
)
def test_a_missing_server_is_one_line_and_a_non_zero_exit_even_with_http_model_set(tmp_path, study):
    sock, url = refusing_url()
    with sock:
        done = run_testbed(
            *study, "executor=http", f"http.url={url}", "http.model=m", "workload.num_requests=4", tmp_path=tmp_path
        )
    # a study's progress bar aside (it redraws one terminal line), the error is the one line printed
    lines = [line for line in done.stderr.replace("\r", "\n").splitlines() if line.strip() and "point/s" not in line]
    assert done.returncode == 1, done.stderr[-2000:]
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"error: http.url={url}: no server answers: GET /v1/models failed (")
    assert lines[0].endswith("and so did GET /health; start the server or fix http.url")
    assert "ClientConnectorError" in lines[0]
    assert not (tmp_path / "requests.parquet").exists()  # nothing was sent


# -- a real checkpoint with default options ------------------------------------------------------------
LONG = 131072  # the llama3 checkpoint's max_position_embeddings: 128 MiB of KV at 1 KiB a token


@pytest.fixture(scope="module")
def long_checkpoint(tmp_path_factory):
    """A checkpoint transformers writes whose max_model_len (131072) a small pool cannot hold."""
    pytest.importorskip("transformers")
    from tests.hf_checkpoints import read_config, write_checkpoint

    directory = tmp_path_factory.mktemp("llama3")
    write_checkpoint("llama3", directory)
    assert read_config(directory)["max_position_embeddings"] == LONG
    return directory


def lowered_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if "model.max_model_len lowered" in line]


@pytest.mark.slow
def test_the_cli_runs_a_checkpoint_the_default_pool_cannot_hold_with_one_line(long_checkpoint, tmp_path):
    small = [
        "engine.kv_cache_mib=8",
        "hardware=cpu",
        "hardware.num_devices=2",
        "mode=disagg",
        "workload.num_requests=6",
        "workload.rate=50",
        "workload.input_len.min=16",
        "workload.input_len.max=64",
        "workload.output_len.min=2",
        "workload.output_len.max=8",
    ]
    done = run_testbed("model=hf", f"model.path={long_checkpoint}", *small, tmp_path=tmp_path / "fitted")
    assert done.returncode == 0, done.stderr[-3000:]
    [line] = lowered_lines(done.stdout + done.stderr)  # one line for both workers
    held = 8 * 2**20 // 1024  # 8 MiB at 1 KiB a token
    assert f"lowered from {LONG} to {held}" in line
    summary = json.loads((tmp_path / "fitted" / "summary.json").read_text())
    assert summary["num_requests"]["ok"] == 6
    # an explicit length keeps the error, in one line
    done = run_testbed(
        "model=hf",
        f"model.path={long_checkpoint}",
        f"model.max_model_len={LONG}",
        *small,
        tmp_path=tmp_path / "explicit",
    )
    assert done.returncode == 2 and f"cannot hold one request of max_model_len={LONG}" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


@pytest.mark.slow
def test_the_cli_runs_the_checkpoint_with_no_option_but_its_path(long_checkpoint, tmp_path):
    done = run_testbed(
        "model=hf",
        f"model.path={long_checkpoint}",
        "workload.num_requests=4",
        "workload.rate=50",
        "workload.input_len.min=16",
        "workload.input_len.max=64",
        "workload.output_len.min=2",
        "workload.output_len.max=8",
        tmp_path=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert len(lowered_lines(done.stdout + done.stderr)) <= 1  # lowered only where the pool cannot hold it


@pytest.mark.slow
def test_the_server_lowers_an_unset_length_to_its_pool_and_serves(long_checkpoint, tmp_path, caplog):
    from testbed.server.app import HttpServer
    from tests.cluster_helpers import make_config

    cfg = make_config(
        "model=hf",
        f"model.path={long_checkpoint}",
        "engine.kv_cache_mib=8",
        "hardware=cpu",
        "cluster.num_workers=1",
        "http.port=0",
    )
    with caplog.at_level(logging.WARNING, logger="testbed"), HttpServer(cfg, tmp_path) as server:
        with urllib.request.urlopen(server.url + "/v1/models", timeout=60) as response:
            [model] = json.loads(response.read())["data"]
        body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 4}).encode()
        request = urllib.request.Request(server.url + "/v1/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            answer = json.loads(response.read())
    assert model["max_model_len"] == 8192
    assert (
        len(
            answer["choices"][0]["token_ids"]
            if "token_ids" in answer["choices"][0]
            else answer["choices"][0]["text"].split()
        )
        == 4
    )
    assert len([r for r in caplog.records if "lowered from 131072 to 8192" in r.getMessage()]) == 1


# -- LLM's offline defaults ---------------------------------------------------------------------------
def test_llm_defaults_prefill_a_whole_batch_at_once_and_decode_it_together():
    import torch

    from testbed import LLM
    from testbed.engine import Sequence
    from testbed.llm import OFFLINE_SCHEDULER

    llm = LLM("tiny", max_model_len=256, num_kv_blocks=32 * 12)  # the scheduler's limits are LLM's defaults
    assert {k: getattr(llm.engine.scheduler.config, k) for k in OFFLINE_SCHEDULER} == OFFLINE_SCHEDULER
    gen = torch.Generator().manual_seed(0)
    for i in range(32):
        llm.engine.add(Sequence(i, torch.randint(0, 512, (128,), generator=gen).tolist(), 8))
    first = llm.engine.step().record
    assert first.prefill_tokens == 32 * 128  # the whole batch in one step
    second = llm.engine.step().record
    assert (second.prefill_tokens, second.decode_seqs) == (0, 32)  # then all of it decodes together
    llm.engine.run_until_done()
    # what the caller gives wins; a chunk given alone bounds the running sequences (chunked mode)
    assert LLM("tiny", max_model_len=256, num_kv_blocks=64, chunk_size=32).engine.scheduler.config.max_running == 32
