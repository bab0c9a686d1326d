"""Every study notebook executes, top to bottom, against the results the tool itself produced
(the `study_results` fixture), with the venv's own python3 kernel; a cell that raises fails it.
The notebooks read their results directory from TESTBED_RESULTS_DIR (their parameters cell)."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.paths import ROOT

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
jupytext = pytest.importorskip("jupytext")

pytestmark = pytest.mark.slow
NOTEBOOKS = ROOT / "analysis" / "notebooks"


def execute(notebook: Path, results_dir: Path) -> None:
    """Run one notebook in a fresh kernel (jupyter_client starts it with this interpreter) with
    the results directory injected through the environment the kernel inherits."""
    nb = nbformat.read(notebook, as_version=4)
    # PYTHONPATH: the kernel imports this checkout's analysis package, however it was installed.
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "TESTBED_RESULTS_DIR": str(results_dir), "PYTHONPATH": path}
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(NOTEBOOKS)}})
    client.execute(env=env)


def studies_with_notebooks(study_results) -> dict:
    """The studies with standard figures (analysis.studies.FIGURES) have a notebook each."""
    from analysis.studies import FIGURES

    assert set(FIGURES) <= set(study_results)
    return {name: path for name, path in study_results.items() if name in FIGURES}


def test_every_study_has_a_paired_notebook(study_results):
    for name in studies_with_notebooks(study_results):
        py, ipynb = NOTEBOOKS / f"{name}.py", NOTEBOOKS / f"{name}.ipynb"
        assert py.is_file() and ipynb.is_file(), name
        paired = jupytext.read(py)  # the .py (reviewed) and the .ipynb hold the same cells
        stored = nbformat.read(ipynb, as_version=4)
        assert [c.source for c in paired.cells] == [c.source for c in stored.cells], name
        assert any("parameters" in c.metadata.get("tags", []) for c in stored.cells), name


def test_notebooks_execute(study_results):
    # Two at a time: most of a notebook's time is its kernel starting and importing.
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(execute, NOTEBOOKS / f"{name}.ipynb", path)
                   for name, path in studies_with_notebooks(study_results).items()}
    errors = {}
    for name, future in futures.items():
        try:
            future.result()
        except nbclient.exceptions.CellExecutionError as error:
            errors[name] = str(error)[-2000:]
    assert not errors, errors
