"""Every study at the smallest size that still exercises it: shared by the experiment tests,
the figure tests and the notebook tests (one run of each per test session)."""

from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir

from testbed.config import override_keys, register_configs, to_config
from testbed.experiments.runner import run
from tests.paths import CONF

register_configs()

COMMON = ["hardware=cpu", "hardware.num_devices=2", "experiment.figures=false", "experiment.repeats=1",
          "experiment.background_margin=0", "workload.num_requests=6",
          "slo.ttft_s=0.5", "slo.tpot_s=0.05"]
STUDIES = {
    "ratio_sweep": ["experiment.rates=[20,40]"],
    "rate_sweep": ["experiment.rates=[20,40]", "experiment.modes=[chunked,disagg]"],
    "mode_compare": [],
    "slo_scale": ["experiment.modes=[colocated,disagg]"],
    "interference": ["experiment.modes=[colocated,disagg]", "experiment.prefill_lengths=[256]",
                     "workload.background_requests=4", "workload.background_output_len=48", "workload.num_requests=3",
                     "workload.rate=20", "experiment.background_margin=1"],
    "chunk_sweep": ["experiment.chunk_sizes=[32,256]", "hardware.num_devices=1"],
    "input_buckets": ["experiment.modes=[chunked,disagg]", "workload.input_len.max=6000"],
    "burstiness": ["experiment.burstiness=[0.5,2.0]", "experiment.modes=[chunked]"],
    "multiturn": ["workload.num_requests=2", "workload.turns=3", "workload.think_time_s=0.05",
                  "experiment.modes=[chunked,disagg]", "experiment.dispatch=[kv_aware]"],
    "kv_bandwidth": ["experiment.message_mib=1"],
    "profile": ["experiment.quick_profile=true"],
    "sim_validate": ["experiment.rates=[20]", "experiment.modes=[chunked]", "hardware.emulate=h100_sxm",
                     "hardware.emulate_model=llama3_8b"],
    "plan": ["experiment.rates=[20,80]", "experiment.chunk_sizes=[64]", "hardware.num_devices=3",
             "workload.num_requests=40"],
}


def compose_study(name: str, *extra: str):
    overrides = [f"+experiment={name}", *COMMON, *STUDIES[name], *extra]
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF)):
        cfg = compose("config", overrides=overrides)
    return to_config(cfg), override_keys(overrides)


def run_study(name: str, out_dir: Path, *extra: str) -> dict:
    cfg, explicit = compose_study(name, *extra)
    return run(cfg, out_dir, explicit)
