"""Every study at the smallest size that still exercises it: shared by the experiment tests,
the figure tests and the notebook tests (one run of each per test session)."""

from __future__ import annotations

from pathlib import Path

from testbed.experiment import ONE_POINT
from testbed.sizing import compose_sized
from testbed.studies import catalog
from testbed.studies.runner import run

# every study but the one point (it has no conf/experiment file), at its tiny size (Study.tiny):
# the notebooks are rendered from the same sizes (python -m analysis.render)
STUDIES = [s.name for s in catalog.STUDIES if s.name != ONE_POINT]


def compose_study(name: str, *extra: str):
    """The study at size=tiny, `extra` winning over its values."""
    return compose_sized(catalog.tiny_overrides(name, *extra))


def run_study(name: str, out_dir: Path, *extra: str) -> dict:
    return run(compose_study(name, *extra), out_dir)
