"""profile: measure the engine on this device (or vLLM's steps, link and front end) and write a
profile for the simulator. A study in one module (testbed/studies/study.py): its settings and its run."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from testbed.cluster.layout import cuda_count
from testbed.config import Config
from testbed.errors import ConfigError
from testbed.studies.machine import model_overrides
from testbed.studies.study import Study

log = logging.getLogger("testbed")


@dataclass(frozen=True)
class Settings:
    """`experiment.own` of profile."""

    quick_profile: bool = False  # fewer shapes and repeats

    def validate(self) -> None:
        if not isinstance(self.quick_profile, bool):
            raise ConfigError(f"experiment.own.quick_profile must be true or false (got {self.quick_profile!r})")


def run(cfg: Config, out_dir: Path, run_point=None, session=None) -> dict:
    """The engine's profile, or with executor=vllm vLLM's (`session`: the run's vLLM deployments)."""
    if cfg.executor == "vllm":
        return run_vllm_profile(cfg, out_dir, session)
    return run_profile(cfg, out_dir)


def run_profile(cfg: Config, out_dir: Path) -> dict:
    # the rule the study's sizing went by (testbed/sizing.py): a GPU box measures its first GPU
    from testbed.measure.step_profile import profile_engine  # torch: loaded where the study runs

    device = "cuda:0" if cuda_count(cfg.hardware) else "cpu"
    profile = profile_engine(cfg.model, cfg.engine, device, quick=STUDY.own_settings(cfg).quick_profile)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "profile.json"
    path.write_text(json.dumps(profile, indent=1) + "\n")
    fit = profile["fit"]["step_relative_error"]
    log.info(
        f"profiled {cfg.model.name} on {device}: {len(profile['samples']['step'])} step samples, "
        f"fit error mean {fit['mean']:.1%} max {fit['max']:.1%}"
    )
    log.info(
        f"wrote {path}\nsimulate with: python -m testbed executor=sim sim.profile={path} ...\n"
        f"plan on it: python -m testbed +experiment=plan {model_overrides(cfg)} sim.profile={path}"
    )
    return {"profile": profile, "path": path}


def run_vllm_profile(cfg: Config, out_dir: Path, pool) -> dict:
    """vLLM's steps, link and front end measured on the pool's model (testbed/deploy/profile.py)."""
    from testbed.deploy.profile import profile_vllm

    profile = profile_vllm(pool, quick=STUDY.own_settings(cfg).quick_profile)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "profile.json"
    path.write_text(json.dumps(profile, indent=1) + "\n")
    fit = profile["fit"]
    log.info(
        f"profiled vLLM serving {pool.model}: {len(profile['samples']['step'])} step samples, fit error mean "
        f"{fit['step_relative_error']['mean']:.1%}; KV link fit error {fit['transfer_relative_error']['mean']:.1%}; "
        f"front end {profile['frontend_latency_s'] * 1e3:.1f} ms"
    )
    log.info(
        f"wrote {path}\nsimulate vLLM with: python -m testbed executor=sim model=hf model.path={pool.model} "
        f"sim.profile={path} sim.frontend_latency_s={profile['frontend_latency_s']:.4f} "
        f"sim.handoff_latency_s={profile['handoff_latency_s']:.4f} ..."
    )
    return {"profile": profile, "path": path}


STUDY = Study(
    "profile",
    "this machine's step times, fitted to the cost model the simulator runs on",
    runs=run,
    one_box=True,
    on_vllm=True,  # vLLM's steps from its metrics (testbed/deploy/profile.py)
    tiny=("experiment.own.quick_profile=true",),
    settings=Settings,
)
