"""What a study's figures plotted, held to what its sweep saved: sweep.json's aggregate,
intervals.parquet (one row per cell, with 95% intervals) and the points' own results, read here
straight from the files. The plotted data comes from analysis.standard_figures.draw or, read
back as JSON, from a notebook's `plotted`; both give {figure stem: what the figure returned}."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from analysis.load import served
from testbed.metrics.latency import BUCKETS
from testbed.metrics.results_dir import read_results
from testbed.metrics.uncertainty import request_units, sample_interval
from testbed.studies.catalog import STUDIES
from testbed.studies.study import Curve

MS = 1e3


class Saved:
    """A sweep directory's saved results, read without analysis.load."""

    def __init__(self, directory: Path):
        self.dir = Path(directory)
        self.aggregate = json.loads((self.dir / "sweep.json").read_text()).get("aggregate") or {}
        self.table = pd.read_parquet(self.dir / "sweep.parquet")
        path = self.dir / "intervals.parquet"
        self.cells = pd.read_parquet(path) if path.is_file() else pd.DataFrame()

    def cell(self, **knobs) -> pd.Series:
        rows = self.cells
        for key, value in knobs.items():
            rows = rows[rows[key] == value]
        assert len(rows) == 1, f"{knobs}: {len(rows)} cells"
        return rows.iloc[0]


def num(value) -> float:
    return np.nan if value is None else float(value)


def expect(plotted, saved, what: str) -> None:
    a, b = np.asarray(plotted, dtype=float), np.asarray(saved, dtype=float)
    assert a.shape == b.shape and np.allclose(a, b, rtol=1e-9, atol=1e-12, equal_nan=True), (
        f"{what}: plotted {a.tolist()} != saved {b.tolist()}"
    )


def expect_bounds(line, rows: pd.DataFrame, column: str, scale: float, what: str) -> None:
    """A line's value and bounds (keys "y"/"low"/"high" or given names) against a cells column."""
    expect(line["y"], rows[column] * scale, what)
    expect(line["low"], rows[f"{column}_low"] * scale, f"{what} low")
    expect(line["high"], rows[f"{column}_high"] * scale, f"{what} high")


# -- one check per figure: (what it plotted, the saved results) --------------------------------------
def goodputs(plotted, saved_goodputs: dict, what: str) -> None:
    assert set(plotted) == set(saved_goodputs), what
    for label, g in saved_goodputs.items():
        expect(plotted[label]["goodput_per_gpu"], g["goodput_per_gpu"], f"{what} {label}")
        expect(plotted[label]["low"], num(g.get("goodput_per_gpu_low")), f"{what} {label} low")
        expect(plotted[label]["high"], num(g.get("goodput_per_gpu_high")), f"{what} {label} high")


def attainment_vs_rate(plotted, saved: Saved) -> None:
    """The grid cells' intervals as saved; every finished point (grid and search) as a dot; the line
    the monotone fit of those points, non-increasing, through the goodput the aggregate saved."""
    done = saved.table[saved.table["status"].isin(["ok", "skipped"])]
    if "overrun" in done.columns:
        done = done[~done["overrun"].fillna(False).astype(bool)]
    for label, rows in saved.cells.groupby("label"):
        rows, line = rows.sort_values("rate"), plotted[label]
        expect(line["grid_rate"], rows["rate"], f"{label} grid rates")
        expect(line["low"], rows["slo_attainment_low"], f"{label} attainment low")
        expect(line["high"], rows["slo_attainment_high"], f"{label} attainment high")
        points = done[done["label"] == label]
        expect(sorted(line["points_rate"]), sorted(points["rate"]), f"{label} every point's rate")
        expect(line["rate"], np.unique(points["rate"]), f"{label} fitted rates")
        assert np.all(np.diff(line["attainment"]) <= 1e-12), f"{label}: the fitted curve rises"
        g = saved.aggregate["goodput"][label]
        expect(
            [line["goodput"], line["goodput_low"], line["goodput_high"]],
            [g["goodput"], num(g.get("goodput_low")), num(g.get("goodput_high"))],
            f"{label} goodput",
        )


def latency_lines(plotted, saved: Saved, metric: str, x: str = "rate") -> None:
    for p, lines in plotted.items():
        assert set(lines) == set(saved.cells["label"]), f"{metric} {p}"
        for label, rows in saved.cells.groupby("label"):
            rows = rows.sort_values(x)
            expect(lines[label]["x"], rows[x], f"{metric}_{p} {label} x")
            expect_bounds(lines[label], rows, f"{metric}_{p}", MS, f"{metric}_{p} {label}")


def latency_vs_rate(plotted, saved: Saved) -> None:
    """The cells' lines as saved; every finished run (a search's rates too) as a dot at its rate;
    each uncensored goodput marked where the aggregate put it."""
    done = saved.table[saved.table["status"].isin(["ok", "skipped"])]
    if "overrun" in done.columns:
        done = done[~done["overrun"].fillna(False).astype(bool)]
    goodput = saved.aggregate.get("goodput") or {}
    for metric in ("ttft", "tpot"):
        latency_lines(plotted[metric], saved, metric)
        for label, line in plotted[metric]["p50"].items():
            expect(sorted(line["runs_x"]), sorted(done[done["label"] == label]["rate"]), f"{label} every run's rate")
            g = goodput.get(label)
            if g and not g.get("goodput_censored"):
                expect(line["crossing"], g["goodput"], f"{label} crossing")


def latency_cdf(plotted, saved: Saved) -> None:
    """A CDF pools a configuration's requests: its percentiles are the cell's pooled estimates."""
    for metric in ("ttft", "itl"):
        assert set(plotted[metric]) == set(saved.cells["label"]), metric
        for label, (x, y) in plotted[metric].items():
            row = saved.cell(label=label)
            assert y[-1] == 1.0
            for p in (50, 99):
                expect(np.percentile(np.asarray(x) / MS, p), row[f"{metric}_p{p}"], f"{label} {metric} p{p}")


def latency_summary(plotted, saved: Saved) -> None:
    points = saved.aggregate["points"]
    for label, by_metric in plotted.items():
        row = saved.cell(label=label)
        for metric, bar in by_metric.items():
            expect(
                [bar["ms"], bar["low"], bar["high"]],
                [row[metric] * MS, row[f"{metric}_low"] * MS, row[f"{metric}_high"] * MS],
                f"{label} {metric}",
            )
            if metric in points[row["cell"]]:  # the aggregate tabulates some of them
                expect(bar["ms"], points[row["cell"]][metric] * MS, f"{label} {metric} aggregate")


def timeline(plotted, saved: Saved, point: str) -> None:
    requests = read_results(saved.dir / "points" / point)["requests"].set_index("request_id")
    segments = pd.DataFrame(plotted)
    for phase, start, end in [
        ("prefill", "prefill_start_s", "prefill_end_s"),
        ("decode", "decode_start_s", "finished_s"),
    ]:
        rows = segments[segments["phase"] == phase]
        assert len(rows), phase
        expect(rows["start_s"], requests.loc[rows["request_id"], start], f"{point} {phase} start")
        expect(rows["end_s"], requests.loc[rows["request_id"], end], f"{point} {phase} end")


def attainment_vs_scale(plotted, saved: Saved) -> None:
    curves = saved.aggregate["curves"]
    assert set(plotted) == set(curves)
    for label, curve in curves.items():
        for key in ("scales", "attainment", "low", "high"):
            expect(plotted[label][key], [num(v) for v in curve[key]], f"{label} {key}")


def itl_inflation(plotted, saved: Saved) -> None:
    agg = saved.aggregate["interference"]
    assert set(plotted["inflation"]) == set(agg) == set(plotted["decode_step"])
    for label, by_length in agg.items():
        lengths = sorted(int(n) for n in by_length if int(n) > 0)
        entries = [by_length[str(n)] for n in lengths]
        line, steps = plotted["inflation"][label], plotted["decode_step"][label]
        expect(line["prefill_len"], lengths, f"{label} lengths")
        for key, saved_key in (("inflation", "inflation"), ("low", "inflation_low"), ("high", "inflation_high")):
            expect(line[key], [num(e[saved_key]) for e in entries], f"{label} {key}")
        expect(steps["with_prefill_ms"], [num(e["decode_step_s_with_prefill"]) * MS for e in entries], label)
        expect(steps["without_prefill_ms"], [num(e["decode_step_s_without_prefill"]) * MS for e in entries], label)


def chunk_tradeoff(plotted, saved: Saved) -> None:
    rows = saved.cells.sort_values("chunk")
    expect(plotted["chunk"], rows["chunk"], "chunks")
    for key, column in (("itl_p99", "itl_p99"), ("ttft", "ttft_p50")):
        expect_bounds(
            {"y": plotted[key], "low": plotted[f"{key}_low"], "high": plotted[f"{key}_high"]}, rows, column, MS, key
        )
        expect(plotted[key], [saved.aggregate["points"][c][column] * MS for c in rows["cell"]], f"{key} aggregate")


def ttft_by_bucket(plotted, saved: Saved) -> None:
    """Each bar: the cell's requests pooled (as the summary's ttft_by_bucket), its interval over the
    runs; with one repeat, the value the aggregate saved."""
    for p, by_label in plotted.items():
        for label, buckets in by_label.items():
            row = saved.cell(label=label)
            points = saved.table.loc[saved.table["cell"] == row["cell"], "point"]
            requests = pd.concat([served_requests(saved.dir / "points" / q).assign(point=q) for q in points])
            for bucket, bar in buckets.items():
                low, high = BUCKETS[bucket]
                inside = requests[(requests["input_len"] >= low) & (requests["input_len"] < high)]
                ttft = inside["ttft"]
                expect(bar["count"], len(ttft), f"{label} {bucket} count")
                expect(bar["ms"], np.percentile(ttft, int(p[1:])) * MS, f"{label} {bucket} {p}")
                interval = sample_interval([u["ttft"].to_numpy(float) for u in request_units(inside)], p)
                expect(
                    [bar["low"], bar["high"]],
                    np.asarray([interval.low, interval.high]) * MS,
                    f"{label} {bucket} {p} bounds",
                )
                if row["repeats"] == 1:
                    saved_value = saved.aggregate["points"][row["cell"]][f"ttft_by_bucket_{bucket}_{p}"]
                    expect(bar["ms"], num(saved_value) * MS, f"{label} {bucket} {p} aggregate")


def served_requests(point_dir: Path) -> pd.DataFrame:
    run = read_results(point_dir)
    return served(run["requests"], run["config"])


def burstiness(plotted, saved: Saved) -> None:
    for label, line in plotted["attainment"].items():
        keys = [str(float(b)) for b in line["x"]]
        expect(line["y"], [saved.aggregate[label][k] for k in keys], f"{label} attainment")
        bounds = np.array([saved.aggregate[f"{label}_interval"][k] for k in keys], dtype=float)
        expect(line["low"], bounds[:, 0], f"{label} low")
        expect(line["high"], bounds[:, 1], f"{label} high")
    latency_lines(plotted["ttft"], saved, "ttft", x="burstiness")


def latency_vs_concurrency(plotted, saved: Saved) -> None:
    for label, line in plotted["throughput"].items():
        keys = [str(int(n)) for n in line["x"]]
        expect(line["y"], [saved.aggregate[label][k] for k in keys], f"{label} throughput")
    for metric in ("ttft", "tpot"):
        latency_lines(plotted[metric], saved, metric, x="concurrency")


def ttft_by_turn(plotted, saved: Saved, name: str = "ttft", y: str = "ttft", scale: float = MS) -> None:
    turns = saved.aggregate["turns"]
    assert set(plotted) == set(turns)
    for cell, body in turns.items():
        keys = [str(int(t)) for t in plotted[cell]["turn"]]
        assert sorted(keys, key=int) == sorted(body[f"{name}_mean_by_turn"], key=int)
        for key, saved_key in ((y, ""), ("low", "_low"), ("high", "_high")):
            saved_values = [num(body[f"{name}_mean_by_turn{saved_key}"][k]) * scale for k in keys]
            expect(plotted[cell][key], saved_values, f"{cell} {key}")


def kv_bytes_by_turn(plotted, saved: Saved) -> None:
    ttft_by_turn(plotted, saved, "kv_bytes", "kv_kib", 1 / 1024)


def decode_itl_with_appends(plotted, saved: Saved) -> None:
    itl = saved.aggregate["decode_itl_p99"]
    for kind in ("with_appends", "decode_only"):
        bars = plotted[kind.replace("_", " ")]
        assert len(bars) == len(itl)
        for (value, low, high), body in zip(bars.values(), itl.values()):
            expect([value, low, high], [num(v) * MS for v in body[kind]], kind)


def kv_bandwidth(plotted, saved: Saved) -> None:
    for key in ("bytes", "raw_gbps", "connector_gbps"):
        expect(plotted[key], saved.table[key], key)
    ipc = sorted(saved.aggregate.get("ipc", {}).get("rows", []), key=lambda r: r["bytes"])
    assert ("ipc_gbps" in plotted) == bool(ipc), "the ipc rows are plotted exactly when measured"
    for key in ("ipc_gbps", "copy_gbps") if ipc else ():
        expect(plotted[key], [r[key] for r in ipc], key)


def placement_goodput(plotted, saved: Saved) -> None:
    """Each heat-map cell is the saved goodput per GPU of the label it names, the best of its cell's
    placements (disagg: same prefill and decode TP; mixed: same mode and TP)."""
    from analysis.style import placement_of

    goodputs = (saved.aggregate.get("simulated") or saved.aggregate)["goodput"]
    placed = {label: placement_of(label) for label in goodputs}
    for key, rows, cols in (("disagg", "prefill_tp", "decode_tp"), ("mixed", "modes", "tp")):
        panel = plotted[key]
        for i, r in enumerate(panel[rows]):
            for j, c in enumerate(panel[cols]):
                label, value = panel["label"][i][j], num(panel["goodput_per_gpu"][i][j])

                def same(p, r=r, c=c):
                    return p and (
                        p[0] == "disagg" and (p[2], p[4]) == (r, c) if key == "disagg" else p[:1] == (r,) and p[2] == c
                    )

                peers = [num(goodputs[k]["goodput_per_gpu"]) for k, p in placed.items() if same(p)]
                if not label:
                    assert not peers and not np.isfinite(value), (key, r, c)
                    continue
                assert same(placed[label]), (key, r, c, label)
                expect(value, goodputs[label]["goodput_per_gpu"], f"placement {label}")
                expect(value, max(peers), f"best of cell {key} {r},{c}")


def sim_vs_real(plotted, saved: Saved) -> None:
    for metric, points in plotted.items():
        assert len(points["label"]) > 0, metric
        for i, (label, rate) in enumerate(zip(points["label"], points["rate"])):
            for executor in ("real", "sim"):
                row = saved.cell(label=label, rate=rate, executor=executor)
                saved_values = [row[metric] * MS, row[f"{metric}_low"] * MS, row[f"{metric}_high"] * MS]
                expect(
                    [points[executor][i], points[f"{executor}_low"][i], points[f"{executor}_high"][i]],
                    saved_values,
                    f"{metric} {executor}",
                )


CHECKS = {
    "goodput_per_gpu": lambda p, s: goodputs(p, s.aggregate["goodput"], "goodput per GPU"),
    "plan_goodput_per_gpu": lambda p, s: goodputs(p, s.aggregate["simulated"]["goodput"], "simulated goodput"),
    "attainment_vs_rate": attainment_vs_rate,
    "latency_vs_rate": latency_vs_rate,
    "latency_cdf": latency_cdf,
    "latency_summary": latency_summary,
    "attainment_vs_slo_scale": attainment_vs_scale,
    "itl_inflation": itl_inflation,
    "chunk_tradeoff": chunk_tradeoff,
    "ttft_by_bucket": ttft_by_bucket,
    "burstiness": burstiness,
    "latency_vs_concurrency": latency_vs_concurrency,
    "ttft_by_turn": ttft_by_turn,
    "kv_bytes_by_turn": kv_bytes_by_turn,
    "decode_itl_with_appends": decode_itl_with_appends,
    "kv_bandwidth": kv_bandwidth,
    "sim_vs_real": sim_vs_real,
    "placement_goodput": placement_goodput,
}


def declared_curve(spec, plotted, saved: Saved) -> None:
    """A curve a study declares (testbed/studies/study.py Curve): each configuration's cells, by
    the knob, as saved, with their intervals where the sweep has them."""
    assert set(plotted) == set(saved.cells["label"]), spec.stem
    for label, rows in saved.cells.groupby("label"):
        rows, line = rows.sort_values(spec.x), plotted[label]
        expect(line["x"], rows[spec.x], f"{spec.stem} {label} x")
        if f"{spec.y}_low" in rows.columns:
            expect_bounds(line, rows, spec.y, 1.0, f"{spec.stem} {label}")
        else:
            expect(line["y"], rows[spec.y], f"{spec.stem} {label}")


CURVES = {f.stem: f for s in STUDIES for f in s.figures if isinstance(f, Curve)}  # declared curves by stem


def check_study(plotted: dict, directory: Path) -> list[str]:
    """Hold every figure's plotted data to the saved results; returns the stems checked. A stem
    without a check fails: a new figure needs one here (a declared Curve has its check already)."""
    saved = Saved(directory)
    for stem, data in plotted.items():
        if stem in CURVES:
            declared_curve(CURVES[stem], data, saved)
        elif stem.startswith("timeline_"):
            timeline(data, saved, stem[len("timeline_") :])
        elif stem.startswith("telemetry_"):
            assert data, stem  # drawn only where NVML recorded something
        else:
            assert stem in CHECKS, f"no check for figure {stem!r} (tests/figure_checks.py)"
            CHECKS[stem](data, saved)
    return sorted(plotted)
