"""`--cfg job` shows what runs: the resolved configuration with the study's own experiment keys
and no other study's, and the grid of points; every study declares the experiment keys its code
reads (Study.keys), checked against the code itself."""

from __future__ import annotations

import ast
import inspect
import re
import subprocess
import sys
from dataclasses import fields

import yaml

from testbed.experiment import COMMON_KEYS, SEARCH_KEYS, ExperimentConfig
from testbed.studies import aggregates, catalog, goodput_search, layouts, machine, placements
from tests.paths import ROOT

OTHER_STUDIES_KEYS = (
    "chunk_sizes",
    "burstiness",
    "slo_scales",
    "prefill_lengths",
    "dispatch",
    "handoffs",
    "message_mib",
)


def test_cfg_job_of_ratio_sweep_shows_its_grid_and_no_other_study_keys():
    run = subprocess.run(
        [sys.executable, "-m", "testbed", "+experiment=ratio_sweep", "--cfg", "job"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr
    shown = yaml.safe_load(run.stdout)
    assert tuple(shown["experiment"]) == catalog.study("ratio_sweep").experiment_keys
    assert not set(OTHER_STUDIES_KEYS) & set(shown["experiment"])
    assert shown["model"]["num_layers"] == 2 and shown["engine"]["block_size"] == 16  # resolved, not null
    assert "sim" not in shown and "vllm" not in shown and "http" not in shown  # executor=real's sections only
    comments = [line[2:] for line in run.stdout.splitlines() if line.startswith("# ")]
    assert any(line.startswith("set per point by ratio_sweep") and "mode" in line for line in comments), comments
    assert "points: 24" in comments  # colocated, chunked, 1P2D and 2P1D at two rates, three repeats
    assert any("2P1D_rate100_r2" in line for line in comments)
    assert comments[-1].startswith("estimate: about ")


def test_cfg_job_of_the_one_point_names_one_point(capsys):
    from testbed.__main__ import job_config, shows_job

    assert shows_job(["--cfg", "job"]) and shows_job(["--cfg=job"]) and not shows_job(["-m", "--cfg", "job"])
    assert not shows_job(["--cfg", "hydra"])
    text = job_config(["executor=sim", "mode=disagg"])
    assert "# points: 1, the configuration as it is" in text
    assert "sim" in yaml.safe_load(text)  # the simulator's section where it runs


MODULES = (catalog, aggregates, placements, machine, goodput_search, layouts)


def _functions(*modules) -> dict[str, ast.FunctionDef]:
    out = {}
    for module in (*modules, *MODULES):  # a study module's own functions first
        for node in ast.walk(ast.parse(inspect.getsource(module))):
            if isinstance(node, ast.FunctionDef):
                out.setdefault(node.name, node)
    return out


def _reads(node: ast.FunctionDef) -> tuple[set[str], set[str]]:
    """The experiment keys a function reads (`<x>.experiment.KEY`, or `e.KEY` after `e = cfg.experiment`)
    and the names of the functions it calls."""
    aliases = {
        t.id
        for n in ast.walk(node)
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Attribute) and n.value.attr == "experiment"
        for t in n.targets
        if isinstance(t, ast.Name)
    }
    keys, calls = set(), set()
    for n in ast.walk(node):
        if isinstance(n, ast.Attribute):
            if isinstance(n.value, ast.Attribute) and n.value.attr == "experiment":
                keys.add(n.attr)
            elif isinstance(n.value, ast.Name) and n.value.id in aliases:
                keys.add(n.attr)
        if isinstance(n, ast.Call):
            calls.add(n.func.id if isinstance(n.func, ast.Name) else getattr(n.func, "attr", ""))
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and re.fullmatch(r"experiment\.\w+", n.value):
            keys.add(n.value.split(".")[1])  # a key a builder sets for its points reads it too
    return keys, calls


def _closure(name: str, functions: dict) -> set[str]:
    seen, todo, keys = set(), [name], set()
    while todo:
        current = todo.pop()
        if current in seen or current not in functions:
            continue
        seen.add(current)
        read, calls = _reads(functions[current])
        keys |= read
        todo.extend(calls)
    return keys


def test_every_study_declares_the_experiment_keys_its_builder_and_aggregate_read():
    for s in catalog.STUDIES:
        own = [sys.modules[s.points.__module__]] if s.points and s.points.__module__ != catalog.__name__ else []
        functions = _functions(*own)
        read = set()
        for part in (s.points, s.aggregate):
            name = getattr(part, "__name__", "")
            if name and name != "<lambda>":
                read |= _closure(name, functions)
        known = {f.name for f in fields(ExperimentConfig)}
        assert read <= known, (s.name, read - known)
        assert read <= set(s.experiment_keys), (
            f"{s.name} reads {sorted(read - set(s.experiment_keys))}: add them to its keys"
        )


def test_every_experiment_key_belongs_to_every_study_or_to_one():
    claimed = {*COMMON_KEYS, *SEARCH_KEYS, *(key for s in catalog.STUDIES for key in s.experiment_keys)}
    assert {f.name for f in fields(ExperimentConfig)} - claimed == set()
    assert claimed <= {f.name for f in fields(ExperimentConfig)}


def test_a_study_module_shows_its_own_settings_and_refuses_a_key_it_does_not_take():
    from testbed.__main__ import job_config
    from testbed.config import compose_config
    from testbed.errors import ConfigError

    shown = yaml.safe_load(job_config(["+experiment=batch_cap", "experiment.own.max_running=[4,16]"]))
    assert shown["experiment"]["own"] == {"max_running": [4, 16]}
    assert "chunk_sizes" not in shown["experiment"] and "concurrencies" not in shown["experiment"]
    study = catalog.study("batch_cap")
    for given, message in (
        (["experiment.own.max_runing=[4]"], "experiment.own has max_runing; batch_cap takes max_running"),
        (["experiment.own.max_running=[0]"], "experiment.own.max_running must be integers >= 1"),
    ):
        cfg = compose_config(["+experiment=batch_cap", *given])
        try:
            study.own_settings(cfg)
        except ConfigError as refused:
            assert str(refused).startswith(message) and "\n" not in str(refused)
        else:
            raise AssertionError(given)
    plain = compose_config(["+experiment=mode_compare", "experiment.own.x=1"])
    try:
        catalog.study("mode_compare").own_settings(plain)
    except ConfigError as refused:
        assert "mode_compare takes none" in str(refused)
    else:
        raise AssertionError("a study without settings took experiment.own")


def test_each_study_shows_its_own_axes_with_their_defaults_and_no_other_studys():
    from testbed.__main__ import job_config

    shown = yaml.safe_load(job_config(["+experiment=interference", "experiment.own.prefill_lengths=[64]"]))
    assert shown["experiment"]["own"] == {"prefill_lengths": [64], "background_margin": 2.0}
    shown = yaml.safe_load(job_config(["+experiment=plan", "size=gpu"]))
    own = shown["experiment"]["own"]
    assert own["chunk_sizes"] == [512, 2048, 8192] and own["tp_degrees"] == [1] and own["placement_requests"] == 200
    assert "prefill_lengths" not in own and "message_mib" not in own
