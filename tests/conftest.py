import os

import pytest
import torch

torch.set_num_threads(1)
os.environ.setdefault("WANDB_MODE", "disabled")


# Test files live in folders that mirror the packages (tests/engine/, tests/sim/, ..., tests/e2e/,
# tests/repo/); workers are given files by file name, so a name is unique across the folders
# (pytest_collection_modifyitems refuses two files of one name).
# The files that read the session's study runs (study_results, repeated_results) share a worker
# under `pytest -n 2`, so the studies run once.
STUDY_READERS = {"test_analysis.py", "test_experiments.py", "test_notebooks.py"}
# Files whose vLLM instances take both cores for minutes: on the same worker as the studies, one after
# the other, so no study's own timing (sim_validate's calibration run) shares its cores with them.
VLLM_FILES = {"test_vllm_serving.py", "test_vllm_cli.py"}


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist (the dev extra): absent without it
def pytest_xdist_make_scheduler(config, log):
    """Tests go to workers a file at a time (a file's module fixtures run once)."""
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            name = nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
            return "studies" if name in STUDY_READERS | VLLM_FILES else name

    return ByFile(config, log)


def pytest_collection_modifyitems(config, items):
    files = {}
    for path in {item.path for item in items}:
        files.setdefault(path.name, []).append(path)
    twice = sorted(
        " and ".join(sorted(str(p.relative_to(config.rootpath)) for p in ps)) for ps in files.values() if len(ps) > 1
    )
    if twice:  # ByFile would put both files on one worker, and STUDY_READERS would name either
        raise pytest.UsageError(f"test file names must be unique across tests/ folders: {', '.join(twice)}")
    has_cuda = torch.cuda.is_available()
    multi = has_cuda and torch.cuda.device_count() >= 2
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
        if "multigpu" in item.keywords and not multi:
            item.add_marker(pytest.mark.skip(reason="needs two or more CUDA devices"))


@pytest.fixture(scope="session")
def study_results(tmp_path_factory):
    """{study: its sweep directory}: every study run once at tiny size (see tests/study_runs.py)."""
    from tests.study_runs import STUDIES, run_study

    root = tmp_path_factory.mktemp("studies")
    return {name: (run_study(name, root / name), root / name)[1] for name in STUDIES}


# ratio_sweep in the simulator (seconds), two repeats per point and rates that cross the SLOs, so
# goodput differs between repeats: figures whose intervals come from across repeats have some.
REPEATED = [
    "executor=sim",
    "experiment.repeats=2",
    "experiment.rates=[20,80,320]",
    "workload.num_requests=40",
    "slo.ttft_s=0.05",
    "slo.tpot_s=0.01",
]


@pytest.fixture(scope="session")
def repeated_results(tmp_path_factory):
    """A ratio_sweep directory whose cells have two repeats each (see REPEATED)."""
    from tests.study_runs import run_study

    out = tmp_path_factory.mktemp("repeated") / "ratio_sweep"
    run_study("ratio_sweep", out, *REPEATED)
    return out
