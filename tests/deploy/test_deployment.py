"""The launch lines executor=vllm builds for each mode (what a user can paste to start an instance by
hand), its refusals in one line, and how a study sizes itself on vLLM. No vLLM runs here."""

import json
import os
import sys
from pathlib import Path

import pytest

from testbed.control.config import ClusterConfig
from testbed.deploy.config import VllmConfig
from testbed.deploy.deployment import MARKER, Host, Shape, instance_specs
from testbed.deploy.install import check_install, parse_version
from testbed.errors import ConfigError
from testbed.sizing import compose_sized

CPU = Host("cpu", 2)


def specs(mode, cluster=ClusterConfig(num_workers=2), vllm=VllmConfig(), host=CPU, chunk=64):
    return instance_specs(Shape.of(mode, cluster, chunk, False), vllm, "/ckpt", host, Path("/cache"))


def flag(spec, name):
    return spec.argv[spec.argv.index(name) + 1]


def test_colocated_prefills_whole_prompts_and_chunked_takes_the_chunk_size():
    colocated, chunked = specs("colocated"), specs("chunked", chunk=128)
    assert all(
        "--no-enable-chunked-prefill" in s.argv and flag(s, "--max-num-batched-tokens") == "2048" for s in colocated
    )
    assert all("--enable-chunked-prefill" in s.argv and flag(s, "--max-num-batched-tokens") == "128" for s in chunked)
    # each instance on its own core, its own port, float32 on CPU
    assert [s.env["VLLM_CPU_OMP_THREADS_BIND"] for s in colocated] == ["0", "1"]
    assert len({s.port for s in colocated}) == 2 and all(flag(s, "--dtype") == "float32" for s in colocated)


def test_disagg_joins_a_producer_and_a_consumer_over_nixl_on_loopback():
    p, d = specs("disagg", ClusterConfig(num_prefill=1, num_decode=1))
    roles = [json.loads(flag(s, "--kv-transfer-config")) for s in (p, d)]
    assert [r["kv_role"] for r in roles] == ["kv_producer", "kv_consumer"]
    assert all(r["kv_connector"] == "NixlConnector" and r["kv_buffer_device"] == "cpu" for r in roles)
    assert p.env["UCX_TLS"] == "tcp" and p.env["UCX_NET_DEVICES"] == "lo"
    assert p.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] != d.env["VLLM_NIXL_SIDE_CHANNEL_PORT"]
    assert p.env["TESTBED_VLLM_KV_CORES"] == "0" and d.env["TESTBED_VLLM_KV_CORES"] == "1"  # NIXL's core: its own
    assert all(MARKER in s.env for s in (p, d))
    assert p.shell_line("python").startswith("PYTHONPATH=") and "--kv-transfer-config" in p.shell_line("python")


def test_gpus_get_their_own_devices_and_tensor_parallel_degrees():
    cluster = ClusterConfig(num_prefill=1, num_decode=2, prefill_tp=2, decode_tp=1)
    p, d0, d1 = specs("disagg", cluster, host=Host("cuda", 4))
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in (p, d0, d1)] == ["0,1", "2", "3"]
    assert flag(p, "--tensor-parallel-size") == "2" and flag(d0, "--tensor-parallel-size") == "1"


def test_a_split_the_machine_cannot_hold_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="needs 3 cores"):
        specs("disagg", ClusterConfig(num_prefill=2, num_decode=1))
    with pytest.raises(ConfigError, match="needs CUDA"):
        specs("disagg", ClusterConfig(num_prefill=1, num_decode=1), VllmConfig(connector="p2pnccl"))


def test_bad_settings_are_refused_naming_the_key():
    for bad, key in ((dict(connector="mooncake"), "vllm.connector"), (dict(kv_space_gib=0), "vllm.kv_space_gib")):
        with pytest.raises(ConfigError, match=key):
            VllmConfig(**bad).validate()


def test_an_interpreter_without_vllm_is_a_one_line_error(tmp_path):
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\nexec {sys.executable} -S -I "$@"\n')  # no site-packages: no vLLM
    fake.chmod(0o755)
    with pytest.raises(ConfigError, match="vLLM is not installed"):
        check_install(str(fake), needs_nixl=True)


def test_versions_are_read_leniently():
    assert parse_version("0.32.0") == (0, 32) and parse_version("0.10.1rc2") == (0, 10)
    assert parse_version("1.0.dev5+cpu") == (1, 0) and parse_version("unknown") == (0, 0)


@pytest.mark.parametrize(
    "study", ["ratio_sweep", "mode_compare", "interference", "rate_sweep", "input_buckets", "multiturn"]
)
def test_every_study_on_vllm_composes_at_its_cpu_size(study):
    cfg = compose_sized([f"+experiment={study}", "executor=vllm", "size=cpu"])
    assert cfg.size == "cpu" and cfg.executor == "vllm" and cfg.hardware.num_devices == 2
    per_core = max(cfg.experiment.rates or [cfg.workload.rate]) / cfg.hardware.num_devices
    assert per_core <= 1.0  # the rates one core serves (about 1 req/s at 256 + 32 tokens)


def test_a_study_vllm_cannot_run_is_refused():
    from testbed.studies.catalog import check_executor

    with pytest.raises(ConfigError, match="executor=vllm runs"):
        check_executor(compose_sized(["+experiment=kv_bandwidth", "executor=vllm", "size=cpu"]))


def test_instances_load_the_site_hook_that_keeps_nixl_on_their_own_cores():
    """The hook ships with the package, and in an interpreter with vLLM it gives NIXL's reserved core
    the instance's own and NIXL's progress thread its pause (skipped there without vLLM)."""
    import importlib.util
    import os
    import subprocess

    from testbed.deploy.deployment import SITE

    assert (SITE / "sitecustomize.py").is_file()
    python = os.environ.get("TESTBED_VLLM_PYTHON", sys.executable)
    has_vllm = subprocess.run([python, "-c", "import importlib.util as u; exit(u.find_spec('vllm') is None)"])
    if has_vllm.returncode:
        pytest.skip("no vLLM here: the hook's effect is checked where vLLM is installed")
    probe = "from vllm.platforms.cpu import CpuPlatform; print(CpuPlatform.discover_numa_topology())"
    env = {**os.environ, "PYTHONPATH": str(SITE), "TESTBED_VLLM_KV_CORES": "1", "VLLM_TARGET_DEVICE": "cpu"}
    done = subprocess.run([python, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
    assert done.stdout.strip().splitlines()[-1] == "[[1]]", done.stderr[-2000:]
    assert importlib.util.find_spec("testbed.deploy") is not None


def test_an_instance_that_fails_to_start_is_one_line_with_its_log_and_leaves_nothing(tmp_path):
    """What vLLM prints when it cannot start (a port taken, a bad flag) ends the start in one line
    naming the instance, its exit status and its last log lines; its process group is gone."""
    import socket

    from testbed.deploy.deployment import Deployment
    from testbed.deploy.instance import InstanceFailed, InstanceSpec
    from tests.deploy.vllm_helpers import processes_of

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        script = f"import socket, sys; socket.socket().bind(('127.0.0.1', {port}))"
        spec = InstanceSpec("m0", "mixed", port, ("-c", script), {MARKER: f"{os.getpid()}:{port}"})
        deployment = Deployment(
            Shape.of("colocated", ClusterConfig(), 64, False), [spec], sys.executable, tmp_path, VllmConfig()
        )
        with pytest.raises(InstanceFailed) as error:
            deployment.start()
    message = str(error.value)
    assert "\n" not in message and "m0" in message and "exit status 1" in message
    assert "Address already in use" in message  # the log's last line, in the error
    assert not processes_of(os.getpid())
