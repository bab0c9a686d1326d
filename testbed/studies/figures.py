"""A study's figures are drawn by the analysis layer (analysis/, above this one), which the experiment
layer does not import: the entry points hand a drawer in (`draw_with`), and a study run with none
writes its results without figures."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Optional

Drawer = Callable[[str, Path], list]  # (study name, sweep directory) -> the PDF and PNG paths written

_drawer: Optional[Drawer] = None


def draw_with(drawer: Optional[Drawer]) -> None:
    """Hand in what draws a study's figures (analysis.standard_figures.study_figures); None: draw nothing."""
    global _drawer
    _drawer = drawer


def study_figures(name: str, sweep_dir: Path) -> list[Path]:
    """The study's standard figures in <sweep_dir>/figures/; [] when no drawer was handed in."""
    return _drawer(name, Path(sweep_dir)) if _drawer is not None else []
