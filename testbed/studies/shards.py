"""A study's points as separate jobs, and the merge that gathers them.

A job with `experiment.shard=I experiment.shards=N` runs block I of N of the study's grid (the
points in the order one process runs them, repeats included, cut into N contiguous blocks whose
sizes differ by at most one); `experiment.points=[...]` runs the named points or cells instead.
Every job writes into one shared results directory (`output_dir=...`): its points under points/,
as a one-process run would, and its table under shards/ (never sweep.json, which the jobs would
overwrite in turn). A shard aggregates nothing.

`experiment.merge=true` on the same directory refuses while a grid point is missing (naming it and
its shard), takes every grid point's row from the shard that ran it, runs the goodput search, and
aggregates: the same sweep.json, intervals and figures as the one-process run. The search runs in
the merge because each of its rates is decided from the grid's results of its configuration.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from testbed.config import Config
from testbed.errors import ConfigError
from testbed.experiment import ExperimentConfig
from testbed.metrics.results_dir import write_json, write_parquet
from testbed.studies.resume import damage
from testbed.studies.sweep import Point, Sweep

SHARDS = "shards"  # <out>/shards/<tag>.parquet: one job's rows
SHOWN = 5  # names listed in a one-line error


def runs_part(e: ExperimentConfig) -> bool:
    """Whether this job runs a part of the grid (a shard, or named points)."""
    return e.shard is not None or bool(e.points)


def check_study(name: str, sweeps: bool, points: list[Point] | None) -> None:
    """Sharding needs a sweep whose points stand alone: a point that reads another's results
    ("{points}") must run after it in one process."""
    if not sweeps:
        raise ConfigError(f"experiment={name} is not a sweep of points: experiment.shard, points and merge need one")
    if points is not None and any("{points}" in str(v) for p in points for v in p.overrides.values()):
        raise ConfigError(f"experiment={name}'s points read other points' results: run it whole, without shards")


def block(points: list[Point], shard: int, shards: int) -> list[Point]:
    """Block `shard` of `shards` contiguous blocks, the first len % shards one point longer."""
    size, extra = divmod(len(points), shards)
    start = shard * size + min(shard, extra)
    return points[start : start + size + (1 if shard < extra else 0)]


def chosen(points: list[Point], e: ExperimentConfig) -> list[Point]:
    """The points this job runs, in the grid's order."""
    if e.shard is not None:
        return block(points, e.shard, e.shards)
    names = {p.name for p in points} | {p.knobs.get("cell") for p in points}
    unknown = [n for n in e.points if n not in names]
    if unknown:
        allowed = ", ".join(p.name for p in points[:SHOWN]) + (" ..." if len(points) > SHOWN else "")
        raise ConfigError(f"experiment.points has {unknown}, not points or cells of this grid (it has {allowed})")
    wanted = set(e.points)
    return [p for p in points if p.name in wanted or p.knobs.get("cell") in wanted]


def tag(e: ExperimentConfig, points: list[Point]) -> str:
    if e.shard is not None:
        return f"shard-{e.shard}-of-{e.shards}"
    return f"points-{points[0].name}-{len(points)}" if points else "points-none"


class ShardSweep(Sweep):
    """A sweep of part of the grid: its table goes to shards/<tag>, not to the study's sweep.json."""

    def __init__(self, cfg: Config, points: list[Point], out_dir: Path, run_point, tracker, name: str):
        super().__init__(cfg, points, out_dir, run_point, tracker)
        self.tag = name

    def added_rows(self) -> list[dict]:
        return []  # points drawn in from elsewhere belong to the merged sweep

    def write(self, aggregate: dict | None = None) -> None:
        directory = self.out_dir / SHARDS
        directory.mkdir(parents=True, exist_ok=True)
        table = self.table()
        write_parquet(directory / f"{self.tag}.parquet", table)
        body = {
            "experiment": self.name,
            "size": self.size,
            "shard": self.tag,
            "points": table.to_dict(orient="records"),
        }
        write_json(directory / f"{self.tag}.json", body)


def missing(points: list[Point], out_dir: Path) -> list[str]:
    """The grid points without a finished, whole results directory."""
    out = []
    for point in points:
        directory = out_dir / "points" / point.name
        if not (directory / "summary.json").is_file() or damage(directory):
            out.append(point.name)
    return out


def check_merge(points: list[Point], out_dir: Path, shards: int) -> None:
    """Refuse a merge while a grid point is missing: it would run there, one after another."""
    gone = missing(points, out_dir)
    if not gone:
        return
    owner = {p.name: f" (shard {i} of {shards})" for i in range(shards) for p in block(points, i, shards)}
    named = ", ".join(n + (owner[n] if shards > 1 else "") for n in gone[:SHOWN])
    more = f" and {len(gone) - SHOWN} more" if len(gone) > SHOWN else ""
    raise ConfigError(
        f"merge: {len(gone)} of {len(points)} grid points are not finished in {out_dir}: {named}{more}; run their "
        f"shards (or resume without experiment.merge to run them here)"
    )


def shard_rows(out_dir: Path) -> dict[str, dict]:
    """{point: its row} from every shard's table, a point's finished row winning."""
    rows: dict[str, dict] = {}
    for path in sorted((out_dir / SHARDS).glob("*.parquet")):
        for row in pd.read_parquet(path).to_dict(orient="records"):
            if row.get("status") == "ok" or row["point"] not in rows:
                rows[row["point"]] = row
    return rows


def adopt(sweep: Sweep, out_dir: Path) -> None:
    """The grid's rows as their shards recorded them (status ok, the host's load while they ran)
    in place of the merge's own `skipped` rows."""
    found = shard_rows(out_dir)
    sweep.rows = [
        _aligned(found[r["point"]], r) if r.get("status") == "skipped" and r["point"] in found else r
        for r in sweep.rows
    ]


def _aligned(shard_row: dict, row: dict) -> dict:
    """A shard's row in its own keys; a key a parquet round trip filled with NaN is dropped."""
    return {k: v for k, v in shard_row.items() if k in row or not _missing(v)}


def _missing(value) -> bool:
    return value is None or (isinstance(value, float) and value != value)


def run_shard(cfg: Config, points: list[Point], out_dir: Path, run_point, tracker) -> dict:
    """This job's part of the grid, into the shared directory; no search, no aggregate."""
    mine = chosen(points, cfg.experiment)
    name = tag(cfg.experiment, mine)
    sweep = ShardSweep(cfg, mine, out_dir, run_point, tracker, name)
    table = sweep.run()
    ok = int(table["status"].isin(["ok", "skipped"]).sum()) if len(table) else 0
    print(
        f"{name}: {ok} of {len(mine)} points finished in {out_dir / 'points'} (of the grid's {len(points)}); "
        f"when every shard has run: python -m testbed +experiment={cfg.experiment.name} experiment.merge=true "
        f"output_dir={out_dir} (with this job's other settings)"
    )
    return {"table": table, "shard": name, "points": [p.name for p in mine]}
