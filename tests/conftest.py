import os

import pytest
import torch

torch.set_num_threads(1)
os.environ.setdefault("WANDB_MODE", "disabled")


def pytest_collection_modifyitems(config, items):
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
