"""`python -m analysis compare RUN_A RUN_B`: per configuration, B - A paired by seed where the runs
share seeds, from the two runs' own intervals otherwise, with each run's code version and host
load; checked on small synthetic results directories and on two real (simulated) tiny studies."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pandas as pd
import pytest

from analysis import compare
from analysis.__main__ import main as analysis_main
from testbed.metrics.uncertainty import Interval, t_quantile
from tests.paths import ROOT

TTFT = {0: 0.100, 1: 0.300, 2: 0.200}  # seed-to-seed spread far above the runs' difference


def write_sweep(directory, seeds, ttft, commit="aaaa1111", load=0.5, goodput=None, intervals=None):
    """A study's directory as the runner writes it, for the cells chunked_rate20 and 1P1D_rate20."""
    rows = []
    for label in ("chunked", "1P1D"):
        for i, seed in enumerate(seeds):
            point = f"{label}_rate20_r{i}"
            rows.append(
                {
                    "point": point,
                    "label": label,
                    "mode": "disagg" if label == "1P1D" else label,
                    "rate": 20.0,
                    "cell": f"{label}_rate20",
                    "repeat": i,
                    "seed": seed,
                    "num_gpus": 2,
                    "status": "ok",
                    "host_load_1m": load,
                    "host_load_1m_end": load + 0.1,
                    "ttft_p99": ttft[seed] + (0.05 if label == "1P1D" else 0.0),
                    "throughput_requests_per_s": 19.0 + seed,
                }
            )
            (directory / "points" / point).mkdir(parents=True)
            meta = {"seed": seed, "git_commit": commit, "git_dirty": False, "hostname": "box", "cpu_count": 2}
            (directory / "points" / point / "meta.json").write_text(json.dumps(meta))
    table = pd.DataFrame(rows)
    table.to_parquet(directory / "sweep.parquet")
    aggregate = {"goodput": goodput} if goodput else {}
    body = {"experiment": "ratio_sweep", "points": rows, "aggregate": aggregate}
    (directory / "sweep.json").write_text(json.dumps(body))
    if intervals is not None:
        pd.DataFrame(intervals).to_parquet(directory / "intervals.parquet")
    return directory


def goodput(values: dict, censored: str = "") -> dict:
    n = len(values)
    return {
        "goodput": sum(values.values()) / n,
        "goodput_per_gpu": sum(values.values()) / n / 2,
        "goodput_censored": censored,
        "goodput_per_repeat": list(values.values()),
        "seeds": list(values),
        "censoring_per_repeat": [censored] * n,
        "error_per_repeat": [0.0] * n,
        "num_gpus": 2,
    }


def row(table, key, figure) -> dict:
    return table[(table["key"] == key) & (table["figure"] == figure)].iloc[0].to_dict()


def test_shared_seeds_are_paired_and_the_workloads_spread_cancels(tmp_path):
    a = write_sweep(tmp_path / "a", [0, 1, 2], TTFT, goodput={"1P1D": goodput({0: 40.0, 1: 60.0, 2: 50.0})})
    slower = {s: v + 0.010 + 0.001 * s for s, v in TTFT.items()}  # B: 10-12 ms slower on every seed
    b = write_sweep(tmp_path / "b", [0, 1, 2], slower, goodput={"1P1D": goodput({0: 44.0, 1: 64.0, 2: 54.0})})
    table = compare.compare(compare.load_side(a), compare.load_side(b))
    ttft = row(table, "chunked_rate20", "ttft_p99")
    half = t_quantile(0.95, 2) * 0.001 / math.sqrt(3)  # sd of the per-seed differences: 0.001
    assert ttft["method"] == "paired" and ttft["seeds_shared"] == 3
    assert ttft["difference"] == pytest.approx(0.011) and ttft["low"] == pytest.approx(0.011 - half, rel=1e-6)
    assert ttft["verdict"] == "B higher"  # unpaired, the 100 ms spread across seeds would hide 11 ms
    assert ttft["a"] == pytest.approx(0.2) and ttft["b"] == pytest.approx(0.211)
    g = row(table, "1P1D", "goodput_per_gpu")  # per GPU: +2 req/s on every seed
    assert g["method"] == "paired" and g["difference"] == pytest.approx(2.0) and g["verdict"] == "B higher"


def test_without_shared_seeds_the_two_intervals_combine_as_independent(tmp_path):
    cells = {
        "cell": ["chunked_rate20", "1P1D_rate20"],
        "label": ["chunked", "1P1D"],
        "repeats": [3, 3],
        "ttft_p99": [0.20, 0.25],
        "ttft_p99_low": [0.17, 0.22],
        "ttft_p99_high": [0.24, 0.29],
        "ttft_p99_note": ["", ""],
    }
    a = write_sweep(tmp_path / "a", [0, 1, 2], TTFT, intervals=cells)
    other = {s + 3: v for s, v in TTFT.items()}
    b = write_sweep(tmp_path / "b", [3, 4, 5], other, commit="bbbb2222", load=1.5, intervals=cells)
    side_a, side_b = compare.load_side(a), compare.load_side(b)
    table = compare.compare(side_a, side_b)
    ttft = row(table, "chunked_rate20", "ttft_p99")
    # B - A = 0 with each side's distances to its bounds added in quadrature (MOVER)
    assert ttft["method"] == "intervals" and ttft["difference"] == 0.0
    assert ttft["low"] == pytest.approx(-math.hypot(0.03, 0.04))
    assert ttft["high"] == pytest.approx(math.hypot(0.04, 0.03))
    assert ttft["verdict"] == "not separated"
    throughput = row(table, "chunked_rate20", "throughput_requests_per_s")  # no cell interval: t over repeats
    assert throughput["method"] == "intervals" and throughput["difference"] == pytest.approx(3.0)
    lines = compare.header_lines(side_a, side_b)
    assert "code aaaa1111" in lines[0] and "code bbbb2222" in lines[1] and "load 1m 1.55 (range 1.50-1.60" in lines[1]
    assert any(line.startswith("code: A ran aaaa1111, B ran bbbb2222") for line in lines)
    assert any("fewer than two shared" in line for line in lines)


def test_a_censored_goodput_is_shown_as_a_bound_and_never_differenced(tmp_path):
    a = write_sweep(tmp_path / "a", [0, 1], TTFT, goodput={"chunked": goodput({0: 80.0, 1: 80.0}, "above")})
    b = write_sweep(tmp_path / "b", [0, 1], TTFT, goodput={"chunked": goodput({0: 60.0, 1: 70.0})})
    table = compare.compare(compare.load_side(a), compare.load_side(b))
    g = row(table, "chunked", "goodput_per_gpu")
    assert math.isnan(g["difference"]) and g["a_bound"] == ">=" and g["b_bound"] == ""
    assert "censored" in g["verdict"]
    assert ">= 40" in compare.table_lines(table)[0]


def test_the_command_prints_writes_its_table_and_figure_and_refuses_what_does_not_match(tmp_path, capsys):
    a = write_sweep(tmp_path / "a", [0, 1, 2], TTFT)
    b = write_sweep(tmp_path / "b", [0, 1, 2], {s: v + 0.01 for s, v in TTFT.items()})
    out = tmp_path / "compare"
    assert analysis_main(["compare", str(a), str(b), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "TTFT p99 ms" in printed and "paired (3 seeds)" in printed and f"figure: {out / 'compare.png'}" in printed
    body = json.loads((out / "compare.json").read_text())
    assert body["a"]["code"] == ["aaaa1111"] and body["b"]["host"]["load_1m"]["points"] == 6
    assert {r["key"] for r in body["rows"]} == {"chunked_rate20", "1P1D_rate20"}
    assert (out / "compare.pdf").is_file() and (out / "compare.txt").is_file()
    (tmp_path / "c").mkdir()
    assert analysis_main(["compare", str(a), str(tmp_path / "c")]) == 2
    assert "neither a study's directory" in capsys.readouterr().err


def test_difference_of_intervals_without_one_side_has_no_interval():
    d = compare.difference_of_intervals(Interval(1.0, 0.5, 1.5), Interval(2.0))
    assert d.estimate == 1.0 and not d.known


@pytest.mark.slow
def test_two_real_tiny_studies_compare_from_the_command_line(tmp_path):
    """Two simulated tiny ratio sweeps, seeds 0 and 1 (nothing to pair), then seed 0 against itself."""
    for name, seed in (("a", 0), ("b", 1)):
        done = subprocess.run(
            [sys.executable, "-m", "testbed", "+experiment=ratio_sweep", "size=tiny", "executor=sim"]
            + [f"seed={seed}", f"hydra.run.dir={tmp_path / name}"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-2000:]
    command = [sys.executable, "-m", "analysis", "compare", str(tmp_path / "a"), str(tmp_path / "b")]
    done = subprocess.run(command + ["--out", str(tmp_path / "ab")], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith(f"A: {tmp_path / 'a'} (ratio_sweep; code ") and "seeds 1)" in done.stdout
    rows = json.loads((tmp_path / "ab" / "compare.json").read_text())["rows"]
    assert {r["key"] for r in rows} >= {"chunked_rate20", "1P1D_rate40", "colocated"}
    assert all(r["seeds_shared"] == 0 for r in rows) and (tmp_path / "ab" / "compare.png").is_file()
    same = subprocess.run(command[:-1] + [str(tmp_path / "a"), "--out", str(tmp_path / "aa")], cwd=ROOT,
                          capture_output=True, text=True)  # fmt: skip
    rows = json.loads((tmp_path / "aa" / "compare.json").read_text())["rows"]
    assert same.returncode == 0 and all(r["difference"] == 0 for r in rows if r["difference"] is not None)
