"""One record per study (testbed/studies/catalog.py STUDIES), held to the other two places a study
lives: conf/experiment/NAME.yaml (one per study but the one point) and the analysis layer's
figure makers (every figure a record names is drawn by one); every study's tiny size composes."""

from __future__ import annotations

import pytest

from analysis.standard_figures import MAKERS
from testbed.config import compose_config, study_names
from testbed.experiment import ONE_POINT, ExperimentConfig
from testbed.studies.catalog import BY_NAME, STUDIES, tiny_overrides
from tests.paths import CONF

FILES = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))


def test_every_experiment_file_has_its_study_and_every_study_its_file():
    assert len(BY_NAME) == len(STUDIES)  # one record per name
    assert sorted(BY_NAME) == sorted([ONE_POINT, *FILES])
    assert ExperimentConfig().name == ONE_POINT  # the one point is what runs without +experiment


def test_experiment_name_takes_the_catalogs_names():
    assert sorted(study_names()) == sorted(BY_NAME)


def test_every_figure_a_study_names_has_a_maker_and_every_maker_a_study():
    named = {figure for s in STUDIES for figure in s.figures if isinstance(figure, str)}  # a Curve is drawn as declared
    assert named == set(MAKERS), (named - set(MAKERS), set(MAKERS) - named)


def test_a_study_is_a_sweep_runs_itself_or_is_the_one_point():
    for s in STUDIES:
        assert (s.points is None) == (s.aggregate is None), s.name
        assert not (s.sweeps and s.runs is not None), s.name
        assert s.description and "\n" not in s.description, s.name
    assert [s.name for s in STUDIES if not s.sweeps and s.runs is None] == [ONE_POINT]


def test_what_merge_reads_is_set_on_mergeable_studies_only():
    for s in STUDIES:
        assert s.mergeable or not (s.rate_axis or s.needs_requests), s.name
        assert s.sweeps or not (s.mergeable or s.searches_goodput), s.name


@pytest.mark.parametrize("name", FILES)
def test_the_tiny_size_composes(name):
    assert compose_config(tiny_overrides(name)).experiment.name == name
