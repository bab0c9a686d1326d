"""scripts/gpu_check --smoke on CPU: every step runs (deps included), the summary reads each step's
real output files (a renamed field would otherwise surface only on the GPU, in its scarce device
time), every log and the table land under $OUT, and the exit status follows the steps: a step that
fails, one the 8-minute budget leaves no time for, and gpu tests all skipped on a machine that has a
GPU (a fake nvidia-smi stands for one). scripts/gpu_deps.py: what the check installs and carries."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.paths import ROOT

STEPS = ["deps", "gpu_tests", "engine", "parity", "disagg_ipc", "kv_ipc"]


def gpu_check(out: Path, *args: str, python: str = sys.executable, **env) -> subprocess.CompletedProcess:
    env = {**os.environ, "OUT": str(out), "PYTHON": python, **env}
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check"), *args], env=env, cwd=ROOT, capture_output=True, text=True
    )


def rows(out: Path) -> list[list[str]]:
    return [line.split("\t") for line in (out / "steps.tsv").read_text().splitlines()]


@pytest.mark.slow
def test_smoke_runs_every_step_and_summarises_them(tmp_path):
    done = gpu_check(tmp_path, "--smoke", GPU_CHECK_STEPS="")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert [r[0] for r in rows(tmp_path)] == STEPS and all(r[1] == "0" for r in rows(tmp_path)), rows(tmp_path)
    summary = done.stdout.split("== gpu_check summary", 1)[1]
    for expected in [
        "of ideal",
        "attention vs SDPA",
        "torch/16/decode",
        "4 of 4 requests ok",
        "KV blocks leaked 0, staging buffers leaked 0",
        "ipc vs memcpy",
        "gpu tests: 0 ran",
    ]:
        assert expected in summary, f"{expected!r} missing from the summary:\n{summary}"
    assert (tmp_path / "summary.txt").read_text() == "\n== gpu_check summary" + summary
    for name in [
        "engine.json",
        "parity.json",
        "kv_ipc.json",
        "disagg_ipc/summary.json",
        "device.txt",
        "gpu_tests.xml",
        *(f"{step}.log" for step in STEPS),
    ]:
        assert (tmp_path / name).exists(), name
    assert "every dependency imports" in (tmp_path / "deps.log").read_text()


def fake_gpu(tmp_path: Path) -> str:
    """A PATH whose nvidia-smi lists a GPU that torch does not see."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: GPU-fake)'\n")
    smi.chmod(0o755)
    return f"{bin_dir}{os.pathsep}{os.environ['PATH']}"


def test_gpu_tests_all_skipped_on_a_machine_with_a_gpu_fail(tmp_path):
    done = gpu_check(tmp_path / "out", "--smoke", GPU_CHECK_STEPS="gpu_tests", PATH=fake_gpu(tmp_path))
    assert done.returncode != 0
    assert [r[:2] for r in rows(tmp_path / "out")] == [["gpu_tests", "1"]]
    log = (tmp_path / "out" / "gpu_tests.log").read_text()
    assert "every gpu test was skipped on a machine with a GPU" in log, log[-2000:]
    assert "(a GPU is present)" in (tmp_path / "out" / "summary.txt").read_text()


def test_gpu_paths_get_one_line_each_and_an_absent_flash_attn_is_not_installed(tmp_path):
    done = gpu_check(tmp_path / "out", "--smoke", GPU_CHECK_STEPS="gpu_tests")
    assert done.returncode == 0, done.stdout[-3000:]
    summary = (tmp_path / "out" / "summary.txt").read_text()
    for line in [
        "flash bf16: paged engine = dense, 256-token blocks",
        "CUDA graphs bf16: the eager tokens",
        "memory-sized KV pool bf16: its largest step runs",
        "triton bf16: paged engine = dense, 16-token",
    ]:
        assert line in summary, summary
    flash = next(x for x in summary.splitlines() if "flash bf16" in x)
    assert flash.endswith("not installed (flash-attn)"), flash
    assert "passed: 1 (15 GPU paths and 1 steps); FAILED: none" in summary, summary


def test_flash_attn_that_imports_with_its_test_skipped_fails(tmp_path):
    fake = tmp_path / "site" / "flash_attn"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        "def flash_attn_varlen_func(*a, **k): pass\ndef flash_attn_with_kvcache(*a, **k): pass\n"
    )
    done = gpu_check(tmp_path / "out", "--smoke", GPU_CHECK_STEPS="gpu_tests", PYTHONPATH=str(tmp_path / "site"))
    assert done.returncode != 0
    log = (tmp_path / "out" / "gpu_tests.log").read_text()
    assert "flash-attn imports but its test was skipped" in log, log[-2000:]
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert "FAILED: flash bf16: paged engine = dense, 256-token blocks, gpu_tests;" in summary, summary


def test_a_failed_step_makes_the_exit_status_non_zero(tmp_path):
    # a python that cannot run the steps: every step fails, the table still prints
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nexit 3\n")
    fake.chmod(0o755)
    done = gpu_check(tmp_path / "out", "--smoke", python=str(fake), GPU_CHECK_STEPS="")
    assert done.returncode != 0
    assert [r[0] for r in rows(tmp_path / "out")] == STEPS and all(r[1] != "0" for r in rows(tmp_path / "out"))


def test_steps_the_budget_leaves_no_time_for_fail_without_running(tmp_path):
    done = gpu_check(tmp_path, "--smoke", GPU_CHECK_BUDGET_S="0", GPU_CHECK_STEPS="deps engine")
    assert done.returncode != 0
    assert rows(tmp_path) == [["deps", "124", "0"], ["engine", "124", "0"]]
    assert "not run, the 0s budget is spent" in (tmp_path / "engine.log").read_text()


def test_the_budget_is_eight_minutes():
    text = (ROOT / "scripts" / "gpu_check").read_text()
    assert "BUDGET_S=${GPU_CHECK_BUDGET_S:-480}" in text


@pytest.mark.parametrize("args", [["--fast"], ["--smoke", "--fast"]])
def test_an_unknown_argument_is_refused_in_one_line(tmp_path, args):
    done = gpu_check(tmp_path, *args)
    assert done.returncode == 2
    assert done.stderr.strip() == f"gpu_check: unknown arguments '{' '.join(args)}' (allowed: none, or --smoke)"


def test_an_unknown_step_is_refused_in_one_line(tmp_path):
    done = gpu_check(tmp_path, "--smoke", GPU_CHECK_STEPS="engine bogus")
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "gpu_check: unknown step 'bogus' in GPU_CHECK_STEPS (allowed: deps gpu_tests engine parity disagg_ipc kv_ipc)"
    )


def load_gpu_deps():
    spec = importlib.util.spec_from_file_location("gpu_deps", ROOT / "scripts" / "gpu_deps.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def third_party_imports() -> set[str]:
    """Top-level modules testbed imports at module level (what a step's import chain can reach)."""
    import ast

    found = set()
    for path in (ROOT / "testbed").rglob("*.py"):
        for node in ast.parse(path.read_text()).body:
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module]
                if isinstance(node, ast.ImportFrom) and node.level == 0
                else []
            )
            found |= {n.split(".")[0] for n in names}
    return found - set(sys.stdlib_module_names) - {"testbed", "__future__"}


def test_every_import_is_checked_and_the_light_ones_carried():
    deps = load_gpu_deps()
    checked = {deps.module_name(r) for r in deps.requirements()}
    assert third_party_imports() <= checked, third_party_imports() - checked
    carried = {deps.dist_name(r) for r in deps.carried()}
    assert {"tqdm", "pytest", "hydra-core", "omegaconf", "pyzmq", "antlr4-python3-runtime", "aiohttp"} <= carried
    assert not carried & deps.STOCK


def test_missing_packages_are_named_for_the_install(monkeypatch):
    deps = load_gpu_deps()
    absent = {"tqdm", "pytest", "zmq"}
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name in absent else real(name))
    assert deps.missing() == ["tqdm", "pyzmq", "pytest"]


def test_gpu_wheels_carries_what_gpu_deps_lists():
    text = (ROOT / "scripts" / "gpu_wheels").read_text()
    assert "scripts/gpu_deps.py carried" in text and "pip download" in text


@pytest.mark.parametrize(
    "decode_ratio, ipc_ratio, verdict",
    [
        (0.10, 0.9, "thresholds: MISSED: engine decode batch 1 graphs 0.10 < 0.25 of ideal"),
        (0.60, 0.2, "thresholds: MISSED: kv_ipc 64 MiB 0.20 < 0.50 of the copy"),
        (0.60, 0.9, "thresholds: every measured path reached its floor"),
    ],
)
def test_each_measured_path_is_held_to_its_floor_on_a_gpu(tmp_path, decode_ratio, ipc_ratio, verdict):
    """Off --smoke the summary holds the engine's ratios and the ipc copy to their floors: a path that
    runs but reads a tenth of its roofline fails the check. (The budget of 0 s runs no step; the
    summary reads the figures left in $OUT.)"""
    out = tmp_path / "out"
    out.mkdir()
    engine = {
        "model": "llama3_8b",
        "backend": "triton",
        "block_size": 16,
        "hbm_gbps": 4000,
        "matmul_tflops": 700,
        "rows": [
            {"what": "decode", "batch": 1, "graphs": True, "seconds": 0.01, "ratio": decode_ratio},
            {"what": "prefill", "tokens": 2048, "graphs": False, "seconds": 0.1, "ratio": 0.6},
        ],
    }
    kv = {
        "ipc": {
            "copy": "cudaMemcpy",
            "rows": [{"bytes": 1 << 20, "ratio": 0.1}, {"bytes": 64 << 20, "ratio": ipc_ratio}],
        }
    }
    (out / "engine.json").write_text(json.dumps(engine))
    (out / "kv_ipc.json").write_text(json.dumps(kv))
    done = gpu_check(out, GPU_CHECK_BUDGET_S="0", GPU_CHECK_STEPS="engine kv_ipc")
    summary = (out / "summary.txt").read_text()
    assert verdict in summary, summary
    assert done.returncode != 0  # the steps the budget left no time for fail too
