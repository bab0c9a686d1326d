"""Every study notebook executes, top to bottom, against the results the tool itself produced
(the `study_results` fixture, and ratio_sweep also against `repeated_results`), with the venv's
own python3 kernel; a cell that raises fails it. The notebooks read their results directory from
TESTBED_RESULTS_DIR (their parameters cell), else the study's newest run under outputs/<study>/.

Each notebook ends by leaving what its figures plotted in `plotted`; the test appends a cell that
prints it as JSON, reads it back from the executed notebook's output, and holds it to the saved
summaries (tests/figure_checks.py)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from testbed.studies.catalog import STUDIES
from tests.figure_checks import check_study
from tests.paths import ROOT

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
jupytext = pytest.importorskip("jupytext")
KernelManager = pytest.importorskip("jupyter_client.manager").KernelManager

pytestmark = pytest.mark.slow
NOTEBOOKS = ROOT / "analysis" / "notebooks"
READBACK = "from analysis.plotted import dumps\n\nprint(dumps(plotted))"
# study -> the figures it draws: the built-in studies' makers; a study module's declared curves are
# drawn by `python -m analysis RESULTS` and need no notebook of their own (testbed/studies/study.py)
DRAWN = {s.name: s.figures for s in STUDIES if any(isinstance(f, str) for f in s.figures)}


def execute(notebook: Path, results_dir: Path | None, folder: Path = NOTEBOOKS) -> dict:
    """Run one notebook, and a last cell printing its `plotted` as JSON, in a fresh kernel
    (jupyter_client starts it with this interpreter, in `folder`) with the results directory
    injected through the environment the kernel inherits (None: none, the notebook's default);
    returns `plotted` as read back from that cell's output."""
    nb = nbformat.read(notebook, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(READBACK))
    # PYTHONPATH: the kernel imports this checkout's analysis package, however it was installed.
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {k: v for k, v in os.environ.items() if k != "TESTBED_RESULTS_DIR"} | {"PYTHONPATH": path}
    if results_dir is not None:
        env["TESTBED_RESULTS_DIR"] = str(results_dir)
    # over unix sockets in a directory of its own: kernels started side by side over TCP may pick
    # the same free port (jupyter_client frees the ports it probed before the kernel binds them)
    with tempfile.TemporaryDirectory(prefix="nb-") as sockets:
        km = KernelManager(kernel_name="python3", transport="ipc", ip=os.path.join(sockets, "kernel"))
        client = nbclient.NotebookClient(
            nb, km=km, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(folder)}}
        )
        client.execute(env=env)
    return printed_json(nb.cells[-1])


def printed_json(cell) -> dict:
    """What a cell printed to stdout, parsed as JSON (NaN allowed, as json.dumps writes it)."""
    text = "".join(out.get("text", "") for out in cell.outputs if out.output_type == "stream" and out.name == "stdout")
    return json.loads(text)


def studies_with_notebooks(study_results) -> dict:
    """The studies with standard figures (Study.figures) have a notebook each."""

    assert set(DRAWN) <= set(study_results)
    return {name: path for name, path in study_results.items() if name in DRAWN}


def test_every_study_has_a_paired_notebook(study_results):
    for name in studies_with_notebooks(study_results):
        py, ipynb = NOTEBOOKS / f"{name}.py", NOTEBOOKS / f"{name}.ipynb"
        assert py.is_file() and ipynb.is_file(), name
        paired = jupytext.read(py)  # the .py (reviewed) and the .ipynb hold the same cells
        stored = nbformat.read(ipynb, as_version=4)
        assert [c.source for c in paired.cells] == [c.source for c in stored.cells], name
        assert any("parameters" in c.metadata.get("tags", []) for c in stored.cells), name
        assert stored.cells[-1].source.startswith("plotted = "), f"{name}: the last cell leaves `plotted`"


def test_notebooks_execute_and_plot_the_saved_summaries(study_results, repeated_results):
    runs = {name: (name, path) for name, path in studies_with_notebooks(study_results).items()}
    runs["ratio_sweep, 2 repeats"] = ("ratio_sweep", repeated_results)
    # Two at a time: most of a notebook's time is its kernel starting and importing.
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {key: pool.submit(execute, NOTEBOOKS / f"{name}.ipynb", path) for key, (name, path) in runs.items()}
    errors = {}
    for key, future in futures.items():
        name, path = runs[key]
        try:
            stems = check_study(future.result(), path)
            assert len(stems) >= len(DRAWN[name]) - 1, f"figures plotted: {stems}"  # no telemetry on CPU
        except nbclient.exceptions.CellExecutionError as error:
            errors[key] = str(error)[-2000:]
        except AssertionError as error:
            errors[key] = f"plotted data against the saved results: {error}"
    assert not errors, errors


def test_a_notebook_reads_its_studys_newest_run_by_default(repeated_results, tmp_path):
    """No TESTBED_RESULTS_DIR: a notebook in a checkout's analysis/notebooks reads the newest run the
    command wrote under outputs/<study>/<date>/<time>/ (an older, damaged run beside it is not read)."""
    notebooks = tmp_path / "analysis" / "notebooks"
    notebooks.mkdir(parents=True)
    older = tmp_path / "outputs" / "ratio_sweep" / "2026-01-01" / "09-00-00"
    older.mkdir(parents=True)
    (older / "sweep.json").write_text("not a sweep")
    os.utime(older / "sweep.json", (1_000, 1_000))
    newest = tmp_path / "outputs" / "ratio_sweep" / "2026-01-01" / "10-00-00"
    shutil.copytree(repeated_results, newest)
    check_study(execute(NOTEBOOKS / "ratio_sweep.ipynb", None, notebooks), newest)


def test_every_committed_notebook_shows_its_figures():
    """Committed rendered (python -m analysis.render): a reader sees the figures on the repository
    page without running anything."""
    for notebook in sorted(NOTEBOOKS.glob("*.ipynb")):
        nb = json.loads(notebook.read_text())
        images = [
            o
            for c in nb["cells"]
            if c["cell_type"] == "code"
            for o in c.get("outputs", [])
            if "image/png" in o.get("data", {})
        ]
        assert images, f"{notebook.name} has no rendered figure: run python -m analysis.render {notebook.stem}"
        assert nb["metadata"]["rendered_from"].startswith(f"python -m analysis.render {notebook.stem}")
