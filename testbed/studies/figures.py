"""A study's figures are drawn by the analysis layer (analysis/, above this one), which the studies
layer does not import: analysis registers its drawer as the package's `testbed.figures` entry
point (pyproject.toml), found here when a study draws. An install without it (or without
matplotlib) writes its results without figures."""

from __future__ import annotations

import logging
from functools import lru_cache
from importlib.metadata import entry_points
from pathlib import Path
from typing import Callable, Optional

from testbed.notices import warn_once

log = logging.getLogger("testbed")

Drawer = Callable[[str, Path], list]  # (study name, sweep directory) -> the PDF and PNG paths written


@lru_cache(maxsize=1)  # one lookup a process: the installed entry points do not change while it runs
def drawer() -> Optional[Drawer]:
    """analysis.standard_figures.study_figures, by its entry point; None where none is installed."""
    found = entry_points(group="testbed.figures", name="study")
    return next(iter(found)).load() if found else None


def study_figures(name: str, sweep_dir: Path) -> list[Path]:
    """The study's standard figures in <sweep_dir>/figures/; [] where no drawer is installed (said
    once: an install older than the entry point needs `pip install -e .` again)."""
    draw = drawer()
    if draw is None:
        warn_once(
            log,
            "figures: not drawn, no `testbed.figures` entry point is installed (pip install -e . again); "
            f"`python -m analysis {sweep_dir}` draws them from the results",
        )
        return []
    return draw(name, Path(sweep_dir))
