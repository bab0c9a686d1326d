"""What this machine gives a study: its device count, its GPU in the analytical table, and the
command that measures a profile of it for the configured model."""

from __future__ import annotations

from testbed.cluster.layout import cuda_count
from testbed.config import Config


def num_devices(cfg: Config) -> int:
    if cfg.hardware.num_devices is not None:
        return cfg.hardware.num_devices
    count = cuda_count(cfg.hardware)
    if count:
        return count
    return 2


def missing_profile(cfg: Config, key: str, spec: str | None) -> str:
    """One line: which profile is missing and the commands that make or replace it."""
    from testbed.perf import GPUS

    what = f"{key}={spec} was measured on a CPU" if spec else f"{key} is unset (a shipped CPU profile by default)"
    analytical = gpu_here() or " | ".join(sorted(GPUS))
    return (
        f"{what}, but experiment={cfg.experiment.name} on this GPU box simulates this GPU: measure it with "
        f"`{profile_command(cfg)}` and pass {key}=<its profile.json>, or take the roofline: {key}={analytical}"
    )


def profile_command(cfg: Config) -> str:
    """The profile study for the configured model: its shape (and context) is what the profile must match."""
    return f"python -m testbed +experiment=profile {model_overrides(cfg)}"


def model_overrides(cfg: Config) -> str:
    """The command-line settings that give another run this run's model (`model=NAME model.KEY=...`)."""
    from dataclasses import fields

    from testbed.model.config import ModelArgs

    model = cfg.model
    out = ["model=hf", f"model.path={model.path}"] if model.path else [f"model={model.name}"]
    keys = [f.name for f in fields(ModelArgs) if f.name != "rope_scaling"]
    return " ".join(out + [f"model.{k}={getattr(model, k)}" for k in keys if getattr(model, k) is not None])


def gpu_here() -> str | None:
    """The analytical table's name for CUDA device 0 (None without CUDA or for a GPU it lacks)."""
    import torch

    from testbed.perf.resolve import table_gpu

    return table_gpu(torch.cuda.get_device_name(0)) if torch.cuda.is_available() else None
