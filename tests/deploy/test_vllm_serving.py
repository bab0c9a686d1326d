"""Real vLLM under the testbed (skipped where vLLM is not installed): the same greedy tokens from the
testbed's own engine, a colocated vLLM instance and vLLM's 1P1D over NIXL, on a checkpoint that
transformers wrote; an instance killed mid-point ends in one line with the finished requests kept
and nothing left running. Instances are shared by the tests of this file."""

import os
import signal
import threading
import time
import urllib.request
from pathlib import Path

import pandas as pd
import pytest

from testbed.deploy.checkpoint import bundled_checkpoint
from testbed.deploy.config import VllmConfig
from testbed.deploy.deployment import Deployments, Host
from testbed.deploy.instance import InstanceFailed
from testbed.sizing import compose_sized
from testbed.studies.executors import vllm_point
from tests.deploy.vllm_helpers import port_free, processes_of, vllm_python

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
POINT = ["executor=vllm", "size=cpu", "workload.num_requests=4", "workload.rate=4", "workload.output_len.max=24"]


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    python = vllm_python()
    vllm = VllmConfig(python=python)
    cache = Path(os.environ.get("TESTBED_VLLM_CACHE", "~/.cache/testbed/vllm")).expanduser()  # the run's default
    model = bundled_checkpoint(cache, python)
    # colocated (one instance) and 1P1D up together: the tests of this file share them
    with Deployments(
        vllm, str(model), Host("cpu", os.cpu_count() or 1), cache, tmp_path_factory.mktemp("logs"), keep=2
    ) as p:
        yield p
    assert not processes_of(os.getpid()), "an instance outlived its pool"


def point(pool, tmp_path, *overrides):
    cfg = compose_sized([*POINT, *overrides, f"vllm.python={pool.python}", f"vllm.model={pool.model}"])
    return vllm_point(cfg, tmp_path, pool, progress=False), cfg


def test_own_engine_vllm_colocated_and_vllm_1p1d_give_the_same_tokens(pool, tmp_path):
    from testbed import LLM

    colocated, _ = point(pool, tmp_path / "colocated", "mode=colocated", "cluster.num_workers=1")
    disagg, _ = point(pool, tmp_path / "disagg", "mode=disagg", "cluster.num_prefill=1", "cluster.num_decode=1")
    requests = colocated["requests"].set_index("request_id")
    assert (requests["status"] == "ok").all(), requests["reason"].tolist()
    prompts = [list(colocated["prompts"][rid]) for rid in requests.index]
    own = LLM(model=pool.model, device="cpu").generate(prompts, max_new_tokens=requests["output_len"].tolist())
    vllm_colocated = [list(ids) for ids in requests["output_token_ids"]]
    vllm_disagg = [
        list(ids) for ids in disagg["requests"].set_index("request_id").loc[requests.index, "output_token_ids"]
    ]
    assert vllm_colocated == own
    assert vllm_disagg == own
    # the hand-off measured per request, and vLLM's own view of the same point
    transfers = pd.read_parquet(tmp_path / "disagg" / "kv_transfers.parquet")
    assert len(transfers) == len(requests) and (transfers["end_s"] >= transfers["start_s"]).all()
    instances = disagg["summary"]["vllm"]["instances"]
    assert instances["d0"]["kv_transfer_s"]["count"] == len(requests)  # NIXL's own transfer times, from /metrics
    assert instances["p0"]["prompt_tokens"] >= requests["input_len"].sum()
    meta = disagg["meta"]["vllm"]
    assert meta["version"] and "--kv-transfer-config" in meta["instances"]["p0"]["launch"]


def test_a_killed_decode_instance_ends_the_point_in_one_line_and_leaves_nothing(pool, tmp_path):
    disagg = next(d for shape, d in pool.up.items() if shape.mode == "disagg")
    decode = disagg.of("decode")[0]
    ports = [i.spec.port for i in disagg.instances]
    killer = threading.Thread(target=kill_when_decoding, args=(decode,), daemon=True)
    killer.start()
    with pytest.raises(InstanceFailed, match="d0 died during the point") as error:
        point(
            pool, tmp_path, "mode=disagg", "cluster.num_prefill=1", "cluster.num_decode=1",
            "workload.num_requests=8", "workload.output_len.min=40", "workload.output_len.max=40",
        )  # fmt: skip
    assert "\n" not in str(error.value)
    requests = pd.read_parquet(tmp_path / "requests.parquet")  # the point's results are written
    assert len(requests) == 8 and (requests["status"] == "failed").any()
    assert requests.loc[requests["status"] == "failed", "reason"].str.len().gt(0).all()
    pool.stop_all()
    assert not processes_of(os.getpid())
    assert all(port_free(port) for port in ports)


def kill_when_decoding(instance, timeout_s: float = 300.0) -> None:
    """SIGKILL the instance's whole process group once it is decoding a request."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(instance.spec.url + "/metrics", timeout=5) as response:
                text = response.read().decode()
        except OSError:
            return
        running = [line for line in text.splitlines() if line.startswith("vllm:num_requests_running")]
        if running and float(running[0].split()[-1]) >= 1:
            os.killpg(instance.pid, signal.SIGKILL)
            return
        time.sleep(0.05)
