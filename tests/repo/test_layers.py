"""Imports point down the layers: the simulator, the control layer and the engine never pull in
the studies layer or the process code (launcher, router, connector, receiver, worker).

Each module is imported in a process of its own (forked from one that has loaded torch and the
other third-party libraries once), so a module is judged by its own imports, not by what an
earlier one left in sys.modules. `import torch` itself loads torch.multiprocessing, so that one
is checked in the source instead: no module-level import of it.
"""

from __future__ import annotations

import ast
import json
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.paths import ROOT

PACKAGE = ROOT / "testbed"
PROCESS_CODE = (
    "testbed.cluster.launcher",
    "testbed.cluster.router",
    "testbed.cluster.connector",
    "testbed.cluster.receiver",
    "testbed.cluster.worker",
)
BELOW_STUDIES = ("testbed.studies", *PROCESS_CODE)  # what sim, control and the plan helpers may not load
ENGINE = ("testbed.cluster", "testbed.sim", "testbed.studies")  # the engine knows no cluster and no simulator
LAYERS = {"testbed.sim": BELOW_STUDIES, "testbed.control": BELOW_STUDIES, "testbed.engine": ENGINE}
PLAN_HELPERS = {"testbed.cluster.layout": BELOW_STUDIES, "testbed.ports": BELOW_STUDIES}
# loaded once before the forks, to keep each child's import short; none of them is a testbed module
PRELOAD = ("torch", "numpy", "pandas", "omegaconf", "hydra", "testbed")

CHILD = r"""
import importlib, json, os, sys, traceback
preload, cases = sys.argv[1], json.loads(sys.argv[2])
for name in json.loads(preload):
    try:
        importlib.import_module(name)
    except ImportError:
        pass
def loaded(forbidden):
    return sorted(m for m in sys.modules if any(m == f or m.startswith(f + ".") for f in forbidden))
early = loaded(sorted({f for fs in cases.values() for f in fs}))
sys.stdout.flush()
for module, forbidden in cases.items():
    pid = os.fork()
    if pid == 0:
        try:
            importlib.import_module(module)
            row = {"module": module, "error": None, "loaded": loaded(forbidden)}
        except BaseException:
            row = {"module": module, "error": traceback.format_exc(limit=3), "loaded": []}
        if early:
            row["error"] = f"loaded before {module} was imported: {early}"
        sys.stdout.write(json.dumps(row) + "\n")
        sys.stdout.flush()
        os._exit(0)
    os.waitpid(pid, 0)
"""


def modules_of(package: str) -> list[str]:
    """`package` and every module under it, found on disk (nothing imported); [] if it is absent."""
    path = PACKAGE.joinpath(*package.split(".")[1:])
    if not path.is_dir():  # with or without __init__.py: a namespace package imports too
        return []
    found = [package]
    for info in pkgutil.iter_modules([str(path)]):
        name = f"{package}.{info.name}"
        found += modules_of(name) if info.ispkg else [name]
    return found


def cases() -> dict[str, tuple[str, ...]]:
    out = {module: forbidden for package, forbidden in LAYERS.items() for module in modules_of(package)}
    return {**out, **PLAN_HELPERS}


def source_of(module: str) -> Path:
    path = PACKAGE.joinpath(*module.split(".")[1:])
    # a module beside a same-named data folder (x.py beside x/) is the .py file
    return path.with_suffix(".py") if path.with_suffix(".py").is_file() else path / "__init__.py"


def module_level_imports(tree: ast.Module) -> list[str]:
    """Modules named by imports that run at import time (top level, or in a top-level if/try);
    imports inside functions run only when called, so they are the sanctioned way to defer."""
    names, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            todo += [child for child in ast.iter_child_nodes(node) if isinstance(child, ast.stmt)]
            todo += [s for handler in getattr(node, "handlers", []) for s in handler.body]
    return names


CASES = cases()


@pytest.fixture(scope="module")
def imports() -> dict[str, dict]:
    """{module: {"error", "loaded"}} for every case, from one forking subprocess."""
    if not hasattr(os, "fork"):
        pytest.skip("the per-module import check forks (POSIX only)")
    out = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(PRELOAD), json.dumps(CASES)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return {row["module"]: row for row in rows}


@pytest.mark.parametrize("module", list(CASES))
def test_module_imports_point_down(imports, module):
    row = imports.get(module)
    assert row is not None, f"{module}: the child process reported nothing"
    assert row["error"] is None, f"{module} failed to import:\n{row['error']}"
    assert not row["loaded"], f"importing {module} loads {row['loaded']}"


@pytest.mark.parametrize("module", list(CASES))
def test_no_module_level_torch_multiprocessing(module):
    path = source_of(module)
    names = module_level_imports(ast.parse(path.read_text())) if path.is_file() else []  # namespace package
    assert not [n for n in names if n == "torch.multiprocessing" or n.startswith("torch.multiprocessing.")], (
        f"{module} imports torch.multiprocessing at import time: import it inside the function that spawns"
    )


def test_discovery_finds_the_layers():
    assert {"testbed.sim.pools", "testbed.engine.kv_pool", "testbed.cluster.layout"} <= set(CASES)


def test_kv_leak_error_lives_in_errors():
    from testbed.errors import KVLeakError

    assert KVLeakError.__module__ == "testbed.errors"
