"""Build typed configs for cluster tests without the command line."""

from __future__ import annotations

import queue
import time

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from testbed.config import Config, register_configs, to_config
from tests.paths import CONF

register_configs()


def make_config(*overrides: str) -> Config:
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF)):
        cfg = compose("config", overrides=list(overrides))
    return to_config(cfg)


def small_workload(n: int = 10, rate: float = 40.0) -> list[str]:
    """Short prompts and outputs at a high rate, so steps batch several requests together."""
    return [f"workload.num_requests={n}", f"workload.rate={rate}", "workload.input_len.min=20",
            "workload.input_len.max=120", "workload.output_len.min=6", "workload.output_len.max=20",
            "hardware=cpu", "model.max_model_len=256", "engine.num_kv_blocks=256"]


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
