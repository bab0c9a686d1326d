"""The catalog of studies: the one table of `Study` records (STUDIES), each study's module
(testbed/studies/NAME.py: its settings, points, aggregate and figures), and what every study shares:
which executor can run it, its tiny size.

Every study runs on the same N devices (hardware.num_devices, or every visible GPU) so that its
configurations compare at equal hardware: colocated and chunked use N mixed workers, and a
disaggregated split pP:dD has p + d = N.

A new study is three files: testbed/studies/NAME.py (its settings, points, aggregate and declared
figures, and its record STUDY: testbed/studies/study.py), conf/experiment/NAME.yaml, and
experiments/NAME/README.md; module_studies finds it by its YAML (testbed/studies/batch_cap.py is one
such module; the built-in ones are listed in BUILT_IN below).
"""

from __future__ import annotations

import logging
from importlib import import_module

from testbed.cluster.layout import cuda_count
from testbed.config import Config, study_names
from testbed.errors import ConfigError
from testbed.experiment import ONE_POINT
from testbed.studies import (
    burstiness,
    chunk_sweep,
    concurrency_sweep,
    input_buckets,
    interference,
    kv_bandwidth,
    mode_compare,
    multiturn,
    plan,
    profile,
    rate_sweep,
    ratio_sweep,
    replay,
    sim_validate,
    slo_scale,
)
from testbed.studies.machine import missing_profile
from testbed.studies.study import Study

log = logging.getLogger("testbed")


def check_executor(cfg: Config) -> None:
    """What runs the study can run it here: over HTTP only the traffic studies (Study.over_http);
    simulated on a GPU box only on a GPU's profile (check_profiles)."""
    if cfg.executor == "http" and not study(cfg.experiment.name).over_http:
        over_http = ", ".join(s.name for s in STUDIES if s.over_http)
        raise ConfigError(
            f"executor=http runs {over_http}; experiment={cfg.experiment.name} varies or "
            f"measures the testbed's own engine"
        )
    if cfg.executor == "vllm" and not study(cfg.experiment.name).on_vllm:
        on_vllm = ", ".join(s.name for s in STUDIES if s.on_vllm)
        raise ConfigError(
            f"executor=vllm runs {on_vllm}; experiment={cfg.experiment.name} varies or measures the testbed's "
            f"own engine"
        )
    check_profiles(cfg)


# -- the simulator's device on a GPU box ----------------------------------------------------------
ROLES = ("mixed", "prefill", "decode")


def check_profiles(cfg: Config) -> None:
    """On a GPU box a simulated study stands for this GPU, so each role runs on a GPU's profile:
    one measured here (sim.profile=<profile.json>, as a CPU box runs on its shipped CPU profile)
    or a GPU of the analytical table. Unset, the simulator would load the shipped CPU profile;
    rather than swap in the roofline unasked, the study stops and says how to measure this GPU.
    sim_validate's simulated points fit theirs in situ on this GPU's real points when unset."""
    if not simulates(cfg) or not cuda_count(cfg.hardware):
        return
    from testbed.perf.resolve import profile_device

    for role in ROLES:
        spec = cfg.sim.spec(role)
        if spec is None and study(cfg.experiment.name).fits_in_situ:
            continue
        if spec is None or profile_device(spec) == "cpu":
            raise ConfigError(missing_profile(cfg, cfg.sim.key(role), spec))


def simulates(cfg: Config) -> bool:
    """The study's points run in the simulator: executor=sim, plan, or sim_validate's half."""
    chosen = study(cfg.experiment.name)
    return cfg.executor == "sim" or chosen.simulated or chosen.fits_in_situ


# the one table: the one point, then each built-in study's module (the order `--help` lists them in)
BUILT_IN = (
    Study(ONE_POINT, "one point with the config as it is", over_http=True, on_vllm=True),
    ratio_sweep.STUDY,
    rate_sweep.STUDY,
    mode_compare.STUDY,
    slo_scale.STUDY,
    interference.STUDY,
    chunk_sweep.STUDY,
    input_buckets.STUDY,
    burstiness.STUDY,
    concurrency_sweep.STUDY,
    multiturn.STUDY,
    kv_bandwidth.STUDY,
    profile.STUDY,
    sim_validate.STUDY,
    plan.STUDY,
    replay.STUDY,
)  # batch_cap, a study of three files, is found by its YAML (module_studies): the path a new study takes


def module_studies(built_in: tuple[Study, ...]) -> tuple[Study, ...]:
    """The studies written as one module each: a conf/experiment/NAME.yaml with no record above is
    testbed/studies/NAME.py, whose STUDY is its record (testbed/studies/study.py)."""
    known = {s.name for s in built_in}
    found = []
    for name in (n for n in study_names() if n not in known):
        module = import_module(f"testbed.studies.{name}")
        record = getattr(module, "STUDY", None)
        if not isinstance(record, Study) or record.name != name:
            raise ConfigError(
                f"conf/experiment/{name}.yaml has no study: testbed/studies/{name}.py must define "
                f"STUDY = Study({name!r}, ...)"
            )
        found.append(record)
    return tuple(found)


STUDIES = BUILT_IN + module_studies(BUILT_IN)
BY_NAME = {s.name: s for s in STUDIES}

# what every tiny run shares: two CPU workers, one repeat, a handful of requests, no figures
TINY_BASE = (
    "hardware=cpu",
    "hardware.num_devices=2",
    "experiment.figures=false",
    "experiment.repeats=1",
    "experiment.search_points=1",
    "workload.num_requests=6",
    "slo.ttft_s=0.5",
    "slo.tpot_s=0.05",
)


# executor=vllm on CPU (size=cpu): real vLLM instances on one core each (two cores: 1P1D against two
# colocated and two chunked instances), the test checkpoint's 30 layers at rates one core serves
VLLM_CPU_BASE = (
    "hardware=cpu",
    "hardware.num_devices=2",
    "model.name=tiny",  # the own engine's model is not what runs; vllm.model is
    "workload.num_requests=24",
    "workload.rate=0.5",
    "workload.length_scale=1.0",
    "workload.input_len.dist=uniform",
    "workload.input_len.min=32",
    "workload.input_len.max=384",
    "workload.output_len.dist=uniform",
    "workload.output_len.min=8",
    "workload.output_len.max=40",
    "scheduler.chunk_size=64",
    "slo.ttft_s=1.0",
    "slo.tpot_s=0.15",
)
VLLM_TINY = (
    "experiment.figures=false",
    "experiment.repeats=1",
    "experiment.search_points=0",
    "experiment.rates=[1.0]",
    "workload.num_requests=4",
)


def study(name: str) -> Study:
    if name not in BY_NAME:
        raise ConfigError(f"experiment.name={name!r} is not one of {', '.join(BY_NAME)}")
    return BY_NAME[name]


def tiny_values(chosen: Study) -> list[str]:
    """What `size=tiny` adds on top of the study's CPU size (testbed/sizing.py)."""
    return [*TINY_BASE, *chosen.tiny]


def tiny_overrides(name: str, *extra: str) -> list[str]:
    """The command line of the study's tiny run (the tests' and `python -m analysis.render`'s),
    before testbed/sizing.py adds the size's values."""
    return [f"+experiment={name}", "size=tiny", *extra]
