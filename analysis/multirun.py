"""A Hydra multirun directory (`python -m testbed -m ...`) as one study: its jobs merged.

    <multirun>/multirun.yaml, <multirun>/<n>/   Hydra's jobs, each a run or a study's sweep
    <multirun>/merged/                          one sweep: points/ links to the jobs' points,
                                                sweep.parquet, intervals.parquet, figures/

Each job is labelled by the command-line values that differ between jobs (`mode=disagg`,
`cluster.num_prefill=2`, ...). Jobs that are studies of one kind merge point by point, their
labels extended by the job's; jobs that are single runs become the points of a rate sweep
(`workload.rate` is the x axis) when their rates differ, else of a mode comparison.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import yaml

from testbed.errors import TestbedError
from testbed.studies.merge import load_table, rewrite, sweep_config
from testbed.studies.sweep import flatten

RATE_KEY = "workload.rate"


def is_multirun(directory) -> bool:
    return (Path(directory) / "multirun.yaml").is_file()


def jobs(directory: Path) -> list[tuple[int, Path, dict]]:
    """(job number, its directory, its command-line overrides) of every job with results."""
    found = []
    for job in sorted((p for p in directory.iterdir() if p.name.isdigit()), key=lambda p: int(p.name)):
        overrides = job / ".hydra" / "overrides.yaml"
        if overrides.is_file() and ((job / "summary.json").is_file() or (job / "sweep.json").is_file()):
            given = yaml.safe_load(overrides.read_text()) or []
            found.append((int(job.name), job, dict(o.lstrip("+").split("=", 1) for o in given if "=" in o)))
    if not found:
        raise TestbedError(
            f"{directory}: a multirun directory without finished jobs (no <n>/summary.json or sweep.json)"
        )
    return found


def job_labels(found: list[tuple[int, Path, dict]], leave_out: tuple[str, ...] = ()) -> dict[int, str]:
    """Each job's name: the overrides whose values differ between jobs ("" when none do); the
    value alone when one key varies, so `mode=chunked,disagg` draws as the modes themselves."""
    keys = sorted({k for _, _, o in found for k in o})
    varying = [k for k in keys if k not in leave_out and len({o.get(k) for _, _, o in found}) > 1]
    if len(varying) == 1:
        return {n: str(o.get(varying[0])) for n, _, o in found}
    return {n: ",".join(f"{k.split('.')[-1]}={o.get(k)}" for k in varying) for n, _, o in found}


def merge(directory) -> tuple[str, Path]:
    """Write <multirun>/merged as one sweep of the study the jobs make; (the study, the dir)."""
    directory = Path(directory)
    found = jobs(directory)
    kinds = {(job / "sweep.json").is_file() for _, job, _ in found}
    if len(kinds) > 1:
        raise TestbedError(f"{directory}: its jobs mix single runs and studies; merge jobs of one kind")
    out = directory / "merged"
    (out / "points").mkdir(parents=True, exist_ok=True)
    name, table = _studies(found, out) if kinds == {True} else _runs(found, out)
    cfg = sweep_config(out, table)
    rewrite(out, name, table, cfg)
    return name, out


def _link(out: Path, point: str, target: Path) -> None:
    link = out / "points" / point
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(target.resolve(), target_is_directory=True)


def _studies(found, out: Path) -> tuple[str, pd.DataFrame]:
    names, tables = set(), []
    labels = job_labels(found)
    for number, job, _ in found:
        name, table = load_table(job)
        names.add(name)
        table = table.copy()
        for point in table["point"]:
            _link(out, f"job{number}-{point}", job / "points" / str(point))
        table["point"] = [f"job{number}-{p}" for p in table["point"]]
        table["cell"] = [f"job{number}-{c}" for c in table.get("cell", table["point"])]
        table["label"] = [f"{label} [{labels[number] or f'job{number}'}]" for label in table["label"]]
        tables.append(table)
    if len(names) > 1:
        raise TestbedError(
            f"{out.parent}: its jobs are different studies ({', '.join(sorted(names))}); merge one study"
        )
    return names.pop(), pd.concat(tables, ignore_index=True)


def _runs(found, out: Path) -> tuple[str, pd.DataFrame]:
    labels = job_labels(found, leave_out=(RATE_KEY,))
    rows = []
    for number, job, _ in found:
        config = yaml.safe_load((job / "config.yaml").read_text()) or {}
        summary = json.loads((job / "summary.json").read_text())
        point = f"job{number}"
        _link(out, point, job)
        # nothing but the rate varies: one line, named by its mode
        label = labels[number] or config.get("mode", "run")
        rows.append(
            {
                "point": point,
                "label": label,
                "mode": config.get("mode", ""),
                "rate": float((config.get("workload") or {}).get("rate", float("nan"))),
                "num_gpus": summary.get("num_gpus", 1),
                "error": "",
                "cell": point,
                "repeat": 0,
                "seed": config.get("seed", 0),
                "status": "ok",
                **flatten(summary),
            }
        )
    table = pd.DataFrame(rows)
    several_rates = (table.groupby("label")["rate"].nunique() > 1).any()
    return ("rate_sweep" if several_rates else "mode_compare"), table
