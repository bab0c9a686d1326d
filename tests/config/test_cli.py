"""The command line: the default job end to end, and bad input as one line with exit code 2."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from testbed.model import cpu_ops
from tests.paths import ROOT

CPU_BACKEND = "cpu" if cpu_ops.supports("cpu", torch.float32) else "torch"  # what auto takes here


def cli(*overrides, tmp_path):
    return subprocess.run(
        [sys.executable, "-m", "testbed", f"hydra.run.dir={tmp_path}", *overrides],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
def test_default_job_writes_the_results_contract(tmp_path):
    out = cli("workload.num_requests=12", "workload.rate=20", tmp_path=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    for name in (
        "config.yaml",
        "meta.json",
        "requests.parquet",
        "steps.parquet",
        "kv_transfers.parquet",
        "summary.json",
    ):
        assert (tmp_path / name).is_file(), name
    requests = pd.read_parquet(tmp_path / "requests.parquet")
    assert len(requests) == 12 and (requests.status == "ok").all()
    assert (requests.ttft > 0).all() and (requests.output_token_ids.map(len) == requests.output_len).all()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["kv_blocks_leaked"] == {"worker0": 0}
    meta = json.loads((tmp_path / "meta.json").read_text())  # the backend that ran, and the stack's versions
    assert meta["ranks"]["0"]["attention_backend"] == CPU_BACKEND and {"nccl", "flash_attn", "cuda"} <= set(meta)
    assert "ttft ms" in out.stdout and "throughput" in out.stdout


def test_help_is_short_fast_and_loads_neither_hydra_nor_torch():
    """`--help` answers from the conf/ listing: no Hydra, config, pandas or torch imported, no
    compose (it took 1.6 s and printed Hydra's 274-line config dump)."""
    probe = (
        "import sys, time; t = time.perf_counter(); sys.argv = ['testbed', '--help']\n"
        "from testbed.__main__ import cli; cli()\n"
        "print('seconds', time.perf_counter() - t)\n"
        "print('loaded', [m for m in ('hydra', 'omegaconf', 'torch', 'pandas', 'testbed.config') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[-1] == "loaded []" and float(lines[-2].split()[1]) < 0.5
    text = "\n".join(lines[:-2])
    assert len(lines) - 2 < 50 and "--cfg job" in text and "--hydra-help" in text
    studies = sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml"))
    assert all(f"\n  {name} " in text for name in studies)
    for group in ("hardware", "mode", "model", "tracker", "workload"):
        assert f"\n  {group}: " in text
    assert "llama3_70b" in text and "size: tiny, cpu, gpu" in text
    shown = subprocess.run([sys.executable, "-m", "testbed", "-h"], cwd=ROOT, capture_output=True, text=True)
    assert shown.returncode == 0 and shown.stdout.strip() == text


def test_the_help_finds_the_configs_where_the_config_does_and_its_examples_compose():
    from testbed import __main__ as entry
    from testbed.config import CONF_DIR, check_overrides, register_configs

    register_configs()
    assert entry.conf_dir() == CONF_DIR
    assert len(entry.EXAMPLES) == 5
    for command, _ in entry.EXAMPLES:
        assert command.startswith("python -m testbed")
        assert check_overrides(command.split()[3:]) is None, command


@pytest.mark.parametrize(
    "override, message",
    [
        ("foo=1", "Could not override 'foo'"),
        ("scheduler.chunk_size=abc", "Value 'abc' of type 'str' could not be converted to Integer"),
        (
            "model=gpt5",
            "Could not find 'model/gpt5' Available options in 'model': gpt_oss_120b hf llama2_7b llama31_405b",
        ),
        ("workload.rate=-1", "workload.rate must be > 0 (got -1.0)"),
        ("mode=disagg hardware=cpu hardware.num_devices=1", "needs 2 devices; hardware.num_devices=1 CPU workers"),
        ("engine.attention_backend=flash", "engine.attention_backend=flash needs flash-attn"),
        ("workload.path=/no/such/trace.csv", "trace file '/no/such/trace.csv' not found"),
        ("workload.path=conf", "workload.path: trace conf: not a regular file (a directory); name a file"),
        ("kv_transfer.granularity=layer kv_transfer.decode_binding=late", "kv_transfer.granularity=layer needs"),
        ("faults.drop_kv_probability=2", "faults.drop_kv_probability must be in [0, 1]"),
        ("model.name=gpt5", "model.name='gpt5' is not a preset"),
        ("model.num_heads=5", "model.num_heads=5 must divide model.hidden_size=64"),
        ("model.max_model_len=2048 engine.kv_cache_mib=0.01", "cannot hold one request of max_model_len=2048"),
        ("mode=chunked scheduler.chunk_size=8", "scheduler.chunk_size=8 must be >= scheduler.max_running=64"),
        (
            "kv_transfer.binding=early",
            "kv_transfer.binding was renamed kv_transfer.decode_binding: set kv_transfer.decode_binding instead",
        ),
        (
            "kv_transfer.backend=auto",
            "kv_transfer.backend=auto was renamed kv_transfer.backend=process_group: set "
            "kv_transfer.backend=process_group instead",
        ),
        (
            "+experiment=chunk_sweep experiment.chunk_sizes=[64]",
            "experiment.chunk_sizes was renamed experiment.own.chunk_sizes: set experiment.own.chunk_sizes instead",
        ),
        (
            "+experiment=chunk_sweep size=cpu experiment.own.chunk_size=[64]",
            "experiment.own has chunk_size; chunk_sweep takes",
        ),
        (
            "+experiment=burstiness size=cpu experiment.own.burstiness=[0]",
            "experiment.own.burstiness must be a list of numbers",
        ),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, override, message):
    out = cli(*override.split(), tmp_path=tmp_path)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], out.stderr
    assert "Traceback" not in out.stderr
    if override not in REFUSED_BY_THE_RUN:  # refused as it composed: no run directory, no worker started
        assert not (tmp_path / ".hydra").exists()


# refused once the run has begun: by the plan of this machine's devices, by a worker's KV pool
REFUSED_BY_THE_RUN = (
    "mode=disagg hardware=cpu hardware.num_devices=1",
    "model.max_model_len=2048 engine.kv_cache_mib=0.01",
)


def test_a_renamed_value_is_refused_in_one_line_and_stored_results_read_under_the_new_name():
    """kv_transfer.backend=auto (the KV over the process group) is now process_group: set anywhere
    it is refused naming the new value; a results directory written before the rename resumes."""
    from testbed.config import Config, config_from_dict, upgraded, with_overrides
    from testbed.errors import ConfigError

    message = (
        "kv_transfer.backend=auto was renamed kv_transfer.backend=process_group: "
        "set kv_transfer.backend=process_group instead"
    )
    assert Config().kv_transfer.backend == "process_group"
    with pytest.raises(ConfigError) as info:
        with_overrides(Config(), {"kv_transfer.backend": "auto"})
    assert str(info.value) == message
    stored = {"mode": "disagg", "kv_transfer": {"backend": "auto", "timeout_s": 3.0}}
    with pytest.raises(ConfigError, match=message):
        config_from_dict(stored)
    assert config_from_dict(upgraded(stored)).kv_transfer.backend == "process_group"
    assert stored["kv_transfer"]["backend"] == "auto"  # the stored dict itself is left as read


def test_a_studys_axes_moved_into_its_own_settings_are_refused_by_their_old_key_and_upgraded_when_stored():
    """experiment.chunk_sizes (every study's axes in one flat section) is experiment.own.chunk_sizes,
    the running study's own settings: the old key is refused in one line naming the new one (on the
    command line: test_bad_input_is_one_line_and_exit_2); a results directory written before keeps
    its own study's axes and drops the others."""
    from testbed.config import config_from_dict, upgraded
    from testbed.errors import ConfigError
    from testbed.studies import catalog

    flat = {"chunk_sizes": [64, 256], "burstiness": [0.5], "tp_degrees": [1], "message_mib": 1024, "repeats": 2}
    stored = {"experiment": {"name": "chunk_sweep", **flat}}
    with pytest.raises(ConfigError, match="experiment.chunk_sizes was renamed"):
        config_from_dict(stored)
    cfg = config_from_dict(upgraded(stored))
    assert cfg.experiment.own == {"chunk_sizes": [64, 256]} and cfg.experiment.repeats == 2
    assert catalog.study("chunk_sweep").own_settings(cfg).chunk_sizes == [64, 256]
    plan = config_from_dict(upgraded({"experiment": {"name": "plan", **flat, "placement_requests": 200}}))
    assert plan.experiment.own == {"chunk_sizes": [64, 256], "tp_degrees": [1], "placement_requests": 200}
    served = config_from_dict(upgraded({"experiment": {"name": "serve", **flat}}))
    assert served.experiment.own == {}


def test_prompt_longer_than_max_model_len_is_refused():
    from testbed import LLM
    from testbed.errors import ConfigError

    llm = LLM("tiny", max_model_len=64, num_kv_blocks=8)
    with pytest.raises(ConfigError, match="exceeds model.max_model_len=64"):
        llm.generate([[1] * 60], max_new_tokens=8)


def test_malformed_trace_names_file_and_line(tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\nnot,a,row\n")
    out = cli(f"workload.path={trace}", "workload.arrival=trace", tmp_path=tmp_path / "run")
    assert out.returncode == 2 and "trace.csv" in out.stderr and "line 3" in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_unwritable_output_dir_fails_before_running(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    out = cli(f"output_dir={blocker}/results", tmp_path=tmp_path / "run")
    assert out.returncode == 2
    assert out.stderr.strip() == (
        f"error: output_dir={blocker}/results cannot be written (Not a directory); name a writable directory"
    )


def test_unwritable_hydra_run_dir_is_one_line_not_a_traceback(tmp_path):
    """Hydra creates hydra.run.dir itself and fails with a traceback: the directory is checked first."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    out = subprocess.run(
        [sys.executable, "-m", "testbed", f"hydra.run.dir={blocker}/run"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip() == (
        f"error: hydra.run.dir={blocker}/run cannot be written (Not a directory); name a writable directory"
    )


@pytest.mark.slow
def test_overlength_prompts_are_rejected_with_a_reason(tmp_path):
    out = cli(
        "workload.num_requests=6",
        "workload.rate=50",
        "model.max_model_len=128",
        "workload.overlength=reject",
        tmp_path=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    requests = pd.read_parquet(tmp_path / "requests.parquet")
    rejected = requests[requests.status == "rejected"]
    assert len(rejected) > 0 and rejected.reason.str.startswith("overlength").all()


def composed(command: list[str], cwd: Path, env=None) -> str:
    """The job config `command` composes (--cfg job: composed, resolved and printed with its grid, nothing run)."""
    out = subprocess.run(
        [*command, "--cfg", "job", *COMPOSE], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


COMPOSE = ["+experiment=ratio_sweep", "model=small", "workload=azure_conv", "mode=disagg", "tracker=none"]


def test_the_checkout_composes_the_top_level_conf():
    """`python -m testbed` in the checkout reads conf/ beside testbed/ (nothing of it under testbed/),
    and `--cfg job` shows what runs: on this GPU-less machine the study's CPU size (size=cpu)."""
    from testbed.__main__ import job_config
    from testbed.config import CONF_DIR
    from testbed.sizing import sized

    assert CONF_DIR == ROOT / "conf" and not (ROOT / "testbed" / "conf" / "config.yaml").exists()
    expected = job_config(sized(COMPOSE))
    assert "size: cpu" in expected and "num_devices: 3" in expected  # ratio_sweep's experiment.sizes.cpu
    assert "name: small" in expected  # the command line's model wins over the size's tiny one
    assert composed([sys.executable, "-m", "testbed"], ROOT) == expected


@pytest.mark.slow
def test_a_plain_install_carries_its_configs_and_the_testbed_command(tmp_path):
    """The wheel (what a non-editable install unpacks) holds every Hydra config of conf/, the license
    and the `testbed` console command; installed in another directory, the command composes the
    same configs as the checkout, and the default job composes and serves."""
    import zipfile

    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path / "wheel"),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
        timeout=600,
    )
    wheel = next((tmp_path / "wheel").glob("testbed-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    shipped = {n.split("testbed/conf/", 1)[1] for n in names if n.startswith("testbed/conf/") and n.endswith(".yaml")}
    assert shipped == {str(p.relative_to(ROOT / "conf")) for p in (ROOT / "conf").rglob("*.yaml")}
    assert any(n.endswith("licenses/LICENSE") for n in names)
    entry = next(n for n in names if n.endswith("entry_points.txt"))
    assert "testbed = testbed.__main__:cli" in zipfile.ZipFile(wheel).read(entry).decode()
    site = tmp_path / "site"  # a non-editable install of the wheel alone; its dependencies are this interpreter's
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(site), str(wheel)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    env = {**os.environ, "PYTHONPATH": str(site)}  # ahead of the checkout's editable install
    where = subprocess.run(
        [sys.executable, "-c", "import testbed.config as c; print(c.CONF_DIR)"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert where.stdout.strip() == str(site / "testbed" / "conf"), where.stdout + where.stderr
    command = [str(site / "bin" / "testbed")]
    assert composed(command, tmp_path, env) == composed([sys.executable, "-m", "testbed"], ROOT)
    out = subprocess.run(
        [*command, "workload.num_requests=2", f"hydra.run.dir={tmp_path / 'run'}"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "run" / "summary.json").is_file()
