"""The record of a study: what `+experiment=NAME` runs and what reads its results. The built-in
studies' records are in testbed/studies/catalog.py STUDIES; a study written as one module,
testbed/studies/NAME.py, holds its own (`STUDY`), found by its conf/experiment/NAME.yaml.

A study module is the study in one place: its settings dataclass (`Study.settings`: its own axes,
read from `experiment.own`, composed only when it runs), its point builder, its aggregate, and its
figures declared as data (`Curve`: the analysis layer draws them). With its YAML and its README
(experiments/NAME/README.md), a new study with its own sweep axis and figure is three files."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Callable, Optional, Union

from testbed.config import Config
from testbed.errors import ConfigError
from testbed.experiment import COMMON_KEYS, SEARCH_KEYS, ExperimentConfig
from testbed.studies.sweep import Point

Builder = Callable[[Config], list[Point]]
Aggregate = Callable[..., dict]  # (sweep table, cfg, out_dir) -> sweep.json's aggregate
Runs = Callable[..., dict]  # (cfg, out_dir, run_point, session) -> the study's results


def positive(key: str, values, kind: type = int) -> None:
    """`experiment.own.KEY`: a list of numbers of `kind` (float takes integers too), all > 0 and finite."""
    kinds = (int, float) if kind is float else (kind,)
    fine = isinstance(values, (list, tuple))
    fine = fine and all(isinstance(v, kinds) and not isinstance(v, bool) and 0 < v < math.inf for v in values)
    if not fine:
        what = "integers" if kind is int else "numbers"
        raise ConfigError(f"experiment.own.{key} must be a list of {what} > 0 (got {values!r})")


def one_of(key: str, values, allowed: tuple[str, ...]) -> None:
    """`experiment.own.KEY`: a non-empty list of names from `allowed`."""
    if not isinstance(values, (list, tuple)) or not values or any(v not in allowed for v in values):
        raise ConfigError(f"experiment.own.{key} must be a non-empty list of {', '.join(allowed)} (got {values!r})")


@dataclass(frozen=True)
class Curve:
    """A figure declared as data: a cells' column `y` (intervals.parquet: throughput_requests_per_s,
    ttft_p99, slo_attainment, ...) against the point knob `x`, one line per configuration, each
    cell's 95% interval where the sweep has one. analysis/standard_figures.py draws it."""

    x: str
    y: str
    xlabel: str = ""
    ylabel: str = ""
    log_x: bool = False
    better: str = "higher"  # the caption's direction: higher | lower

    @property
    def stem(self) -> str:
        return f"{self.y}_vs_{self.x}"


Figure = Union[str, Curve]  # a maker's name (analysis/standard_figures.py MAKERS), or a declared curve


@dataclass(frozen=True)
class Study:
    """What `+experiment=NAME` runs, and what reads its results. A sweep has `points` and an
    `aggregate`; a study that is no sweep `runs` itself; with neither, it is the one point."""

    name: str  # its conf/experiment/NAME.yaml (ONE_POINT has none)
    description: str  # one line
    points: Optional[Builder] = None
    aggregate: Optional[Aggregate] = None
    runs: Optional[Runs] = None
    figures: tuple[Figure, ...] = ()  # figure makers by name, or curves declared as data
    searches_goodput: bool = False  # after the grid, a goodput search per configuration (goodput_search.py)
    over_http: bool = False  # its points differ in traffic and SLOs only: executor=http can run it
    on_vllm: bool = False  # its points differ in mode, split, chunk size and traffic: executor=vllm can run it
    one_box: bool = False  # it measures this machine: never under torchrun
    simulated: bool = False  # every point runs in the simulator, whatever the executor
    fits_in_situ: bool = False  # half its points simulated, on profiles fitted to the other, real half
    mergeable: bool = False  # merge.py can draw an outside run beside it: its aggregate groups by label
    rate_axis: bool = False  # merge.py: an outside run's point is <label>_rate<R>, so its rate must be known
    needs_requests: bool = False  # merge.py: its aggregate needs requests; summary-only imports stay out
    tiny: tuple[str, ...] = ()  # size=tiny: on its CPU size and TINY_BASE, the least that exercises it
    # the experiment keys it reads beyond every study's (COMMON_KEYS, and SEARCH_KEYS where it
    # searches goodput): `--cfg job` shows these and no other study's (tests/studies/test_cfg_job.py)
    keys: tuple[str, ...] = ()
    # a study module's settings dataclass: its own axes, given as `experiment.own` (own_settings)
    settings: Optional[type] = None

    @property
    def experiment_keys(self) -> tuple[str, ...]:
        """Every experiment key the study reads, in ExperimentConfig's order."""
        own = {*COMMON_KEYS, *(SEARCH_KEYS if self.searches_goodput else ()), *self.keys}
        own |= {"own"} if self.settings is not None else set()
        return tuple(f.name for f in fields(ExperimentConfig) if f.name in own)

    @property
    def sweeps(self) -> bool:
        return self.points is not None

    def own_settings(self, cfg: Config) -> Any:
        """The study's settings from `experiment.own` (its dataclass's defaults for what is not
        given), checked: a key it does not take, or a value it refuses, is one line."""
        given = dict(cfg.experiment.own)
        if self.settings is None:
            if given:
                raise ConfigError(
                    f"experiment.own holds a study module's settings; experiment={self.name} takes none "
                    f"(got {', '.join(sorted(given))})"
                )
            return None
        allowed = [f.name for f in fields(self.settings)]
        unknown = sorted(set(given) - set(allowed))
        if unknown:
            raise ConfigError(f"experiment.own has {', '.join(unknown)}; {self.name} takes {', '.join(allowed)}")
        settings = self.settings(**given)
        check = getattr(settings, "validate", None)
        if check is not None:
            check()
        return settings
