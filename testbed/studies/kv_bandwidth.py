"""kv_bandwidth: the KV connector's bandwidth against a raw copy, by message size (the KV-transfer
benchmark as a study). A study in one module (testbed/studies/study.py): its settings and its run."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from testbed.config import Config
from testbed.errors import ConfigError
from testbed.metrics.results_dir import write_json, write_parquet
from testbed.studies.figures import study_figures
from testbed.studies.study import Study
from testbed.tracking.run_meta import collect_meta

log = logging.getLogger("testbed")


@dataclass(frozen=True)
class Settings:
    """`experiment.own` of kv_bandwidth."""

    message_mib: int = 1024  # the largest message

    def validate(self) -> None:
        if isinstance(self.message_mib, bool) or not isinstance(self.message_mib, int) or self.message_mib < 1:
            raise ConfigError(f"experiment.own.message_mib must be an integer >= 1 (got {self.message_mib!r})")


def run_kv_bandwidth(cfg: Config, out_dir: Path, run_point=None, session=None) -> dict:
    from testbed.measure.kv_transfer import measure, report_lines  # torch: loaded where the study runs

    results = measure(STUDY.own_settings(cfg).message_mib, repeats=3)
    table = pd.DataFrame(results["rows"])
    out_dir.mkdir(parents=True, exist_ok=True)
    write_parquet(out_dir / "sweep.parquet", table)
    write_json(
        out_dir / "sweep.json",
        {
            "experiment": "kv_bandwidth",
            "points": results["rows"],
            "aggregate": {k: v for k, v in results.items() if k != "rows"},
        },
    )
    write_json(out_dir / "meta.json", collect_meta(cfg.seed))
    figures = []
    if cfg.experiment.figures:
        figures = study_figures("kv_bandwidth", out_dir)
    log.info("\n".join(report_lines(results) + [f"results: {out_dir}"] + [f"figure: {f}" for f in figures]))
    return {"table": table, "aggregate": results, "figures": figures}


STUDY = Study(
    "kv_bandwidth",
    "the KV connector's bandwidth against a raw copy, by message size",
    runs=run_kv_bandwidth,
    figures=("kv_bandwidth",),
    one_box=True,
    tiny=("experiment.own.message_mib=1",),
    settings=Settings,
)
