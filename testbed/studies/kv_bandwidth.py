"""The KV-transfer benchmark as an experiment: bandwidth against message size, connector vs raw."""

from __future__ import annotations

import logging
from pathlib import Path

import pandas as pd

from testbed.config import Config
from testbed.measure.kv_transfer import measure, report_lines
from testbed.metrics.results_dir import write_json, write_parquet
from testbed.studies.figures import study_figures
from testbed.tracking.run_meta import collect_meta

log = logging.getLogger("testbed")


def run_kv_bandwidth(cfg: Config, out_dir: Path) -> dict:
    results = measure(cfg.experiment.message_mib, repeats=3)
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
