"""`+experiment=profile`: measure the engine on this device and write a profile for the simulator."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from testbed.cluster.layout import cuda_count
from testbed.config import Config
from testbed.measure.step_profile import profile_engine
from testbed.studies.machine import model_overrides

log = logging.getLogger("testbed")


def run_profile(cfg: Config, out_dir: Path) -> dict:
    # the rule the study's sizing went by (testbed/sizing.py): a GPU box measures its first GPU
    device = "cuda:0" if cuda_count(cfg.hardware) else "cpu"
    profile = profile_engine(cfg.model, cfg.engine, device, quick=cfg.experiment.quick_profile)
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

    profile = profile_vllm(pool, quick=cfg.experiment.quick_profile)
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
