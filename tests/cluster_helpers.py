"""Build typed configs for cluster tests without the command line."""

from __future__ import annotations

import queue
import time

from omegaconf import OmegaConf

from testbed.config import Config
from testbed.sizing import compose_sized


def make_config(*overrides: str) -> Config:
    """The Config the command line `python -m testbed OVERRIDES` runs here, its size included."""
    return compose_sized(list(overrides))


def sim_args(cfg: Config) -> tuple:
    """What the simulator takes of a root config: the served sections and its own."""
    return cfg.serving, cfg.sim


def small_workload(n: int = 10, rate: float = 40.0) -> list[str]:
    """Short prompts and outputs at a high rate, so steps batch several requests together."""
    return [
        f"workload.num_requests={n}",
        f"workload.rate={rate}",
        "workload.input_len.min=20",
        "workload.input_len.max=120",
        "workload.output_len.min=6",
        "workload.output_len.max=20",
        "hardware=cpu",
        "model.max_model_len=256",
        "engine.num_kv_blocks=256",
    ]


def read_until(box, until, limit_s: float = 60) -> list:
    """Messages read from an inbox until `until(got)` holds; bounded by a deadline far beyond a
    loaded machine's delays."""
    got, deadline = [], time.monotonic() + limit_s
    while not until(got) and time.monotonic() < deadline:
        try:
            got.append(box.get(timeout=0.2))
        except queue.Empty:
            pass
    return got


__all__ = ["make_config", "small_workload", "read_until", "OmegaConf"]
