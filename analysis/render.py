"""python -m analysis.render [STUDY ...]: the study notebooks saved with their outputs.

Each study runs at the smallest CPU size that still exercises it (its tiny run: Study.tiny in
testbed/studies/catalog.py, as the test suite runs it), its notebook executes top to bottom
against those results, and the notebook is written back with every table and figure in it, so a
reader sees them on the repository page without running anything. The paired `.py` files
(jupytext) carry no outputs and stay as they are. About ten minutes for all of them on two
cores.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "analysis" / "notebooks"


def run_small(name: str, out_dir: Path, *extra: str) -> dict:
    """The study at its small size into out_dir (what the notebooks and the tests read)."""
    from testbed.sizing import compose_sized
    from testbed.studies.catalog import tiny_overrides
    from testbed.studies.runner import run

    return run(compose_sized(tiny_overrides(name, *extra)), out_dir)


def execute(notebook: Path, results_dir: Path):
    """The notebook executed in a fresh kernel against results_dir (its outputs filled in)."""
    import nbclient
    import nbformat

    nb = nbformat.read(notebook, as_version=4)
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "TESTBED_RESULTS_DIR": str(results_dir), "PYTHONPATH": path}
    client = nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(notebook.parent)}}
    )
    client.execute(env=env)
    return nb


def render(name: str, scratch: Path) -> Path:
    import nbformat

    from testbed.studies.catalog import tiny_overrides

    notebook = NOTEBOOKS / f"{name}.ipynb"
    results = scratch / name
    run_small(name, results)
    nb = execute(notebook, results)
    tiny = " ".join(tiny_overrides(name))
    nb.metadata["rendered_from"] = f"python -m analysis.render {name} (a small CPU run: {tiny})"
    nbformat.write(nb, notebook)
    return notebook


def main(argv=None) -> int:
    studies = sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb"))
    parser = argparse.ArgumentParser(prog="python -m analysis.render", description=__doc__.splitlines()[0])
    parser.add_argument("studies", nargs="*", metavar="STUDY", help=f"default: all of {', '.join(studies)}")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.studies) - set(studies))
    if unknown:
        parser.error(f"no notebook for {', '.join(unknown)}; allowed: {', '.join(studies)}")
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.studies or studies:
            print(f"rendered {render(name, Path(scratch))}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
