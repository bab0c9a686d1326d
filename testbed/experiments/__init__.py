"""Experiments: what one `python -m testbed ...` command runs, from a typed config."""

from __future__ import annotations

from pathlib import Path

from testbed.config import Config
from testbed.experiments.report import print_run
from testbed.experiments.serve import serve


def run(cfg: Config, out_dir: Path) -> dict:
    result = serve(cfg, out_dir)
    print_run(result["requests"], result["summary"], out_dir)
    return result
