"""`+experiment=profile`: measure the engine on this device and write a profile for the simulator."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from testbed.config import Config
from testbed.sim.profile import profile_engine

log = logging.getLogger("testbed")


def run_profile(cfg: Config, out_dir: Path) -> dict:
    use_cuda = torch.cuda.is_available() and cfg.hardware.name != "cpu"
    device = "cuda:0" if use_cuda else "cpu"
    profile = profile_engine(cfg.model, cfg.engine, device, quick=cfg.experiment.quick_profile)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "profile.json"
    path.write_text(json.dumps(profile, indent=1) + "\n")
    fit = profile["fit"]["step_relative_error"]
    log.info(f"profiled {cfg.model.name} on {device}: {len(profile['samples']['step'])} step samples, "
          f"fit error mean {fit['mean']:.1%} max {fit['max']:.1%}")
    log.info(f"wrote {path}\nsimulate with: python -m testbed executor=sim sim.profile={path} ...")
    return {"profile": profile, "path": path}
