"""Real runs recorded once on a quiet machine, for the tests that judge the simulator against real
runs. Under `pytest -n 2` a real run shares two cores with another test's processes and stalls at
random (one cell's TTFT p50 2-4x off, either way): a live comparison there judges the machine,
not the simulator. The recorded points are whole sweep points, so a study run into a directory
holding them resumes: it keeps them (its resume check refuses them if the study's configuration
has changed since) and runs only the simulated half.

Rerecord on a quiet machine (about 30 s) when the refusal says the configuration changed:

    python -m tests.recorded_runs
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from tests.study_runs import run_study

ROOT = Path(__file__).parent / "data" / "recorded"

# sim_validate over a mixed and a P/D cell at two rates, two repeats each (each repeat's simulation
# is fitted on the other's real run)
SIM_VALIDATE = (
    "experiment.rates=[20,40]",
    "experiment.modes=[colocated,disagg]",
    "workload.num_requests=40",
    "experiment.repeats=2",
    "hardware.emulate=null",
    "hardware.emulate_model=null",
)


def real_points(study: str) -> list[Path]:
    return sorted((ROOT / study).glob("*_real_r*"))


def seed(study: str, out_dir: Path) -> list[Path]:
    """The study's recorded real points copied into `out_dir`'s points; returns their copies."""
    points = out_dir / "points"
    points.mkdir(parents=True, exist_ok=True)
    return [Path(shutil.copytree(p, points / p.name)) for p in real_points(study)]


def record(study: str = "sim_validate", overrides: tuple[str, ...] = SIM_VALIDATE) -> None:
    os.environ.setdefault("WANDB_MODE", "disabled")
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / study
        run_study(study, out, *overrides)
        target = ROOT / study
        shutil.rmtree(target, ignore_errors=True)
        for point in sorted((out / "points").glob("*_real_r*")):
            shutil.copytree(point, target / point.name)
    print(f"recorded: {', '.join(p.name for p in real_points(study))} -> {target}")


if __name__ == "__main__":
    record()
