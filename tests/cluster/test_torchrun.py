"""Two torchrun "nodes" on 127.0.0.1 (two torchrun processes, --node-rank 0 and 1): the same
greedy tokens as the single-box run, results written once by rank 0, and a killed rank fails
the run with one line naming it while nothing is left running."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import torch
import zmq

from testbed.model import cpu_ops
from testbed.ports import free_port
from tests.paths import ROOT, error_lines

CPU_BACKEND = "cpu" if cpu_ops.supports("cpu", torch.float32) else "torch"  # what auto takes here
WORKLOAD = [
    "workload.num_requests=8",
    "workload.rate=40",
    "workload.input_len.min=20",
    "workload.input_len.max=120",
    "workload.output_len.min=6",
    "workload.output_len.max=20",
    "hardware=cpu",
    "model.max_model_len=256",
    "engine.num_kv_blocks=256",
    "cluster.start_timeout_s=120",
]
DEADLINE_S = 240  # far beyond a loaded two-core machine's start-up; the runs take seconds


def torchrun(node: int, port: int, cwd: Path, out: Path, *overrides: str) -> subprocess.Popen:
    """One "node": torchrun's static rendezvous, so --node-rank fixes which node holds rank 0."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc-per-node=1",
        f"--node-rank={node}",
        "--master-addr=127.0.0.1",
        f"--master-port={port}",
        "-m",
        "testbed",
        *overrides,
    ]
    return subprocess.Popen(
        cmd,
        cwd=cwd,
        stdout=open(out / f"node{node}.out", "w"),
        stderr=open(out / f"node{node}.err", "w"),
        start_new_session=True,
    )


def two_nodes(tmp_path: Path, *overrides: str) -> tuple[list[subprocess.Popen], Path]:
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    port = free_port()
    nodes = [torchrun(n, port, cwd, tmp_path, f"hydra.run.dir={tmp_path / 'run'}", *overrides) for n in (0, 1)]
    return nodes, cwd


def finish(nodes: list[subprocess.Popen]) -> list[int]:
    try:
        return [node.wait(timeout=DEADLINE_S) for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)


def single_box(tmp_path: Path, *overrides: str) -> pd.DataFrame:
    out = subprocess.run(
        [sys.executable, "-m", "testbed", f"hydra.run.dir={tmp_path / 'single'}", *overrides],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return pd.read_parquet(tmp_path / "single" / "requests.parquet")


def tokens(requests: pd.DataFrame) -> dict:
    return {int(r.request_id): list(r.output_token_ids) for r in requests.itertuples()}


def descendants(pid: int) -> set[int]:
    found, todo = set(), [pid]
    while todo:
        p = todo.pop()
        try:
            children = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            continue
        for child in map(int, children):
            found.add(child)
            todo.append(child)
    return found


def running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def left_running(pids: set[int]) -> list[int]:
    """Processes still up once the runs ended; helpers that exit on their own (a spawned child's
    resource tracker) are given until the deadline."""
    deadline = time.monotonic() + DEADLINE_S
    while [p for p in pids if running(p)] and time.monotonic() < deadline:
        time.sleep(0.2)
    return [p for p in pids if running(p)]


def wait_for(path: Path, text: str) -> str:
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        content = path.read_text() if path.exists() else ""
        if text in content:
            return content
        time.sleep(0.1)
    raise AssertionError(f"{text!r} never appeared in {path}:\n{path.read_text()[-2000:]}")


def poke(address: str) -> None:
    """A stray client on a rank's message port: an HTTP probe, then a pickle over ZeroMQ."""
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    with socket.create_connection((host, int(port))) as raw:
        raw.sendall(b"GET / HTTP/1.1\r\n\r\n")
    ctx = zmq.Context()
    stray = ctx.socket(zmq.PUSH)
    stray.connect(address)
    stray.send(b"\x80\x04\x95" + bytes(40))
    stray.close(linger=1000)
    ctx.term()


pytestmark = [pytest.mark.slow, pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="Linux /proc")]


@pytest.mark.parametrize(
    "mode", [["mode=disagg"], ["mode=colocated", "cluster.num_workers=2"]], ids=["1P1D", "colocated2"]
)
def test_two_nodes_give_the_single_box_tokens_and_write_results_once(tmp_path, mode):
    nodes, cwd = two_nodes(tmp_path, *mode, *WORKLOAD)
    line = wait_for(tmp_path / "node1.out", "messages on tcp://")
    poke(line.split("messages on ")[1].split()[0])  # during the run: refused, logged, changes nothing
    assert finish(nodes) == [0, 0], (tmp_path / "node0.err").read_text()[-3000:]
    run = tmp_path / "run"
    assert tokens(pd.read_parquet(run / "requests.parquet")) == tokens(single_box(tmp_path, *mode, *WORKLOAD))
    assert list(cwd.iterdir()) == []  # rank 1 wrote nothing: no Hydra directory, no log file
    assert len(list(tmp_path.rglob("summary.json"))) == 2  # this run's and the single-box run's
    meta = pd.read_json(run / "meta.json", typ="series")
    assert {r["node"] for r in meta["ranks"].values()} == {0, 1}
    clock = meta["ranks"]["1"]  # one host: one clock, measured but not applied
    assert not clock["clock_rebased"] and abs(clock["clock_offset_s"]) <= clock["clock_rtt_s"]
    assert {r["attention_backend"] for r in meta["ranks"].values()} == {CPU_BACKEND}
    assert set(meta["messages_refused"]) == {"0", "1"}  # each rank's refused frames by port and reason
    if mode == ["mode=disagg"]:
        transfers = pd.read_parquet(run / "kv_transfers.parquet")
        assert len(transfers) == 8 and transfers.crossed_nodes.all() and (transfers.outcome == "ok").all()
        assert meta["links"] == [{"prefill": 0, "decode": 1, "crosses_nodes": True, "backend": "gloo"}]
    node1 = (tmp_path / "node1.out").read_text()
    assert "dropped" in node1 and "a connection" in node1  # the stray client, logged by rank 1


def test_a_killed_rank_fails_the_run_naming_it_and_leaves_nothing_running(tmp_path):
    long = [o for o in WORKLOAD if not o.startswith("workload.num_requests")] + ["workload.num_requests=4000"]
    nodes, _ = two_nodes(tmp_path, "mode=disagg", *long)
    wait_for(tmp_path / "node0.err", "disagg requests")  # the router is replaying the workload
    family = descendants(nodes[0].pid) | descendants(nodes[1].pid)
    rank1 = [int(p) for p in Path(f"/proc/{nodes[1].pid}/task/{nodes[1].pid}/children").read_text().split()]
    assert len(rank1) == 1
    os.kill(rank1[0], signal.SIGKILL)
    codes = finish(nodes)
    assert codes[0] != 0 and codes[1] != 0
    errors = error_lines((tmp_path / "node0.err").read_text())
    assert len(errors) == 1 and "rank 1 (decode_only) on node 1, host" in errors[0], errors
    assert not left_running(family)
    assert not (tmp_path / "run" / "summary.json").exists()  # a failed point is not written as finished
