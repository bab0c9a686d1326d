"""Every study at the smallest size that still exercises it: shared by the experiment tests,
the figure tests and the notebook tests (one run of each per test session)."""

from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir

from analysis.render import COMMON, SMALL
from testbed.config import override_keys, register_configs, to_config
from testbed.studies.runner import run
from tests.paths import CONF

register_configs()

STUDIES = SMALL  # one table: the notebooks are rendered from the same sizes (python -m analysis.render)


def compose_study(name: str, *extra: str):
    overrides = [f"+experiment={name}", *COMMON, *STUDIES[name], *extra]
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF)):
        cfg = compose("config", overrides=overrides)
    return to_config(cfg), override_keys(overrides)


def run_study(name: str, out_dir: Path, *extra: str) -> dict:
    cfg, explicit = compose_study(name, *extra)
    return run(cfg, out_dir, explicit)
