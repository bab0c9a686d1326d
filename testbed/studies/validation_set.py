"""The validation set: every case of a manifest (tests/data/replay/cases.yaml) replayed, the
engine's host side fitted per engine on its calibration cases, the error reported on the
held-out cases.

    python -m testbed.studies.validation_set tests/data/replay/cases.yaml [--out DIR]

Calibration fits three numbers per group (an engine at a version on a GPU), each a stated term
of the simulator, on the group's calibration cases only (a disaggregated group fits its hand-off
path instead, below):
- the cost model's per-step host time (engine.host_overhead_s, the setup's host_overhead_s),
  from HOST_GRID_S, and its part per sequence sampled (engine.host_overhead_per_seq_s), from
  PER_SEQ_GRID_S: every pair is replayed;
- the front end per request (sim.frontend_latency_s), which delays every request by the same
  time, so it shifts TTFT and E2E by exactly that and changes nothing else: for each pair it is
  found on the replayed figures (FRONTEND_GRID_S), not replayed again.
The triple whose mean absolute error over the calibration cases' figures is least wins (ties:
the smaller values). Everything else (the GPU profile, the roofline) is as shipped; the setup's
own knobs (multi-step scheduling, CUDA graphs, the running cap) are the engine's settings, not
fitted. The held-out cases run at their group's fitted values; a group with no calibration case
names another (`calibrated_by`: the same engine and version on another GPU, model or degree) and
runs at that group's values, so none of its figures was fitted on.

A group of disaggregated setups (policy: disagg) takes the host terms of the group its
calibration case names in `calibrated_by` (the same engine colocated) and fits its hand-off path
on its calibration case: an effective network rate (hardware.internode_gbps, LINK_GRID_GBPS) and
a latency per transfer (hardware.internode_latency_s, LINK_GRID_LATENCY_S), the least MAPE
winning, so what the engine's transfer costs beyond the wire (staging through host memory, a
proxy's second request) is one stated pair of numbers, held out on the other loads and lengths.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Callable, Optional

import yaml

from testbed.config import Config
from testbed.errors import ConfigError
from testbed.interop.reference import relative_error
from testbed.metrics.results_dir import write_json, write_text
from testbed.studies.replay import FITTED, HOST, LINK, load_setup, mape, replay

log = logging.getLogger("testbed")

HOST_GRID_S = (0.0, 1e-3, 2e-3, 3e-3, 4e-3, 6e-3)
# a disaggregated engine's hand-off path, fitted as an effective network: GB/s and a per-transfer latency
LINK_GRID_GBPS = (0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.5, 0.7, 1.0, 2.0, 5.0, 12.5)
LINK_GRID_LATENCY_S = (0.0, 2e-3, 5e-3, 10e-3, 20e-3, 40e-3)
PER_SEQ_GRID_S = (0.0, 25e-6, 50e-6, 100e-6, 200e-6)
FRONTEND_GRID_S = tuple(i * 0.5e-3 for i in range(201))  # 0 to 100 ms
SHIFTED = ("ttft_", "e2e_")  # the figures a fixed front-end delay moves
# the headline figures; a case without one (a published median only) counts its median
HEADLINE = {"ttft": ("ttft_mean", "ttft_p50"), "tpot": ("tpot_p50",), "e2e": ("e2e_mean", "e2e_p50")}
THROUGHPUT = ("throughput_requests_per_s", "throughput_output_tokens_per_s")
# a P/D pair's differences (disagg - colocated) compared: the figures a P/D paper argues with
PAIR_FIGURES = ("ttft_mean", "ttft_p50", "tpot_mean", "tpot_p50", "tpot_p99")
PAIR_BOUND = 0.25  # the difference within 25% of the real one, and of its sign
# calibrated_by: engine_profile: a held-out case run at its setup's engine profile, nothing fitted
# (runs on GPUs and engines no calibration case here covers)
PROFILE = "engine_profile"


def load_manifest(path, only: Optional[str] = None) -> tuple[Path, list[dict]]:
    """The manifest's directory and cases (`only`: the cases whose group starts with it)."""
    path = Path(path)
    data = yaml.safe_load(path.read_text()) or {}
    every = data.get("cases") or []
    cases = [c for c in every if only is None or str(c.get("group")).startswith(only)]
    for case in cases:
        missing = [k for k in ("name", "setup", "group", "role") if k not in case]
        if missing or case["role"] not in ("calibrate", "held_out"):
            raise ConfigError(
                f"{path}: case {case.get('name')!r} needs name, setup, group and role (calibrate | held_out)"
            )
    fitted = {c["group"] for c in cases if c["role"] == "calibrate"}
    for case in cases:
        if case.get("calibrated_by") == PROFILE and case["role"] == "held_out":
            continue
        if case["group"] not in fitted and case.get("calibrated_by") not in fitted:
            raise ConfigError(
                f"{path}: case {case['name']!r}: group {case['group']!r} has no calibration case; "
                f"name one that has in calibrated_by (one of {', '.join(sorted(fitted)) or 'none'}), "
                f"or {PROFILE} (held out at the setup's engine profile)"
            )
    order = list(dict.fromkeys(c["group"] for c in cases if c["role"] == "calibrate"))
    for case in cases:
        if case["role"] == "calibrate" and disaggregated(path.parent, [case]):
            source = case.get("calibrated_by")
            if source not in order[: order.index(case["group"])]:
                raise ConfigError(
                    f"{path}: case {case['name']!r} calibrates a disaggregated group's hand-off path at the host "
                    f"terms of a colocated group calibrated before it: name that group in calibrated_by"
                )
    names = {c["name"] for c in every}
    for pair in data.get("pairs") or []:
        if set(pair) != {"colocated", "disagg"} or not set(pair.values()) <= names:
            raise ConfigError(f"{path}: a pair names two cases of the manifest as colocated and disagg (got {pair})")
    return path.parent, cases


def reference_file(base: Path, case: dict) -> Path:
    """A case's result file: NAME.jsonl (SGLang's bench_serving) or NAME.json (vLLM's bench serve)."""
    return next(
        (p for p in (base / f"{case['name']}.jsonl", base / f"{case['name']}.json") if p.is_file()),
        base / f"{case['name']}.jsonl",
    )


def load_pairs(path) -> list[dict]:
    """The manifest's P/D pairs: {colocated: case name, disagg: case name}, checked by load_manifest."""
    return list((yaml.safe_load(Path(path).read_text()) or {}).get("pairs") or [])


def pair_figures(path) -> tuple:
    """The figures a manifest's pairs compare (`pair_figures:`, as published), else PAIR_FIGURES."""
    return tuple((yaml.safe_load(Path(path).read_text()) or {}).get("pair_figures") or PAIR_FIGURES)


def pair_rows(results: list[dict], pairs: list[dict], figures=PAIR_FIGURES) -> list[dict]:
    """Each pair's difference (disagg - colocated) per figure, real and simulated: whether the
    simulator has its sign, and (sim - real) / |real|."""
    rows_of = {r["name"]: {row["figure"]: row for row in r["rows"]} for r in results}
    calibrated = {r["name"] for r in results if r.get("role") == "calibrate"}
    out = []
    for pair in pairs:
        colocated, disagg = rows_of.get(pair["colocated"]), rows_of.get(pair["disagg"])
        if colocated is None or disagg is None:
            continue
        for figure in figures:
            a, b = colocated.get(figure) or {}, disagg.get(figure) or {}
            if None in (a.get("real"), b.get("real"), a.get("sim"), b.get("sim")):
                continue
            real, sim = b["real"] - a["real"], b["sim"] - a["sim"]
            error = (sim - real) / abs(real) if real else None
            out.append(
                {
                    "colocated": pair["colocated"],
                    "disagg": pair["disagg"],
                    "figure": figure,
                    "real": real,
                    "sim": sim,
                    "same_sign": (real > 0) == (sim > 0),
                    "error": error,
                    "within": error is not None and (real > 0) == (sim > 0) and abs(error) <= PAIR_BOUND,
                    "held_out": not ({pair["colocated"], pair["disagg"]} & calibrated),
                }
            )
    return out


def headline(rows: list[dict]) -> dict:
    """Per headline figure, the (figure name, relative error) the case has: the mean where
    published, else the median; throughput for a case that reports only throughput."""
    by_name = {r["figure"]: r["error"] for r in rows}
    out = {}
    for key, names in HEADLINE.items():
        found = next(((n, by_name[n]) for n in names if by_name.get(n) is not None), None)
        if found:
            out[key] = found
    for name in THROUGHPUT:
        if by_name.get(name) is not None:
            out[name.replace("throughput_", "")] = (name, by_name[name])
    return out


def shifted(rows: list[dict], seconds: float) -> list[dict]:
    """The rows as a replay with every request `seconds` later into the engine would give them:
    TTFT and E2E figures grow by it, the rest are unchanged."""
    out = []
    for row in rows:
        if row["figure"].startswith(SHIFTED) and row["sim"] is not None and seconds:
            sim = row["sim"] + seconds
            row = {**row, "sim": sim, "error": relative_error(sim, row["real"])}
        out.append(row)
    return out


def fit_frontend(runs: list[list[dict]], grid=FRONTEND_GRID_S) -> tuple[float, Optional[float]]:
    """(the front-end delay, the mean of the runs' MAPEs at it): least, ties to the smaller delay."""
    best: tuple[float, Optional[float]] = (0.0, None)
    for seconds in grid:
        errors = [e for e in (mape(shifted(rows, seconds)) for rows in runs) if e is not None]
        score = sum(errors) / len(errors) if errors else None
        if score is not None and (best[1] is None or score < best[1] - 1e-12):
            best = (seconds, score)
    return best


def fit_overhead(scores: dict) -> tuple:
    """The key (host_overhead_s, host_overhead_per_seq_s) with the least score (ties: smaller values)."""
    scored = [(key, value["score"]) for key, value in scores.items() if value["score"] is not None]
    if not scored:
        return (0.0, 0.0)
    return min(scored, key=lambda item: (item[1], item[0]))[0]


def table_mape(results: list[dict], keys=("ttft", "tpot", "e2e")) -> dict:
    """Per headline key, the mean absolute error over the results that have it, and the count."""
    out = {}
    for key in keys:
        errors = [abs(r["headline"][key][1]) for r in results if key in r["headline"]]
        out[key] = {"mape": sum(errors) / len(errors) if errors else None, "cases": len(errors)}
    return out


def validate(
    manifest,
    out_dir,
    cfg: Config,
    run_point: Callable,
    grid=HOST_GRID_S,
    per_seq_grid=PER_SEQ_GRID_S,
    only: Optional[str] = None,
) -> dict:
    base, cases = load_manifest(manifest, only)
    out_dir = Path(out_dir)
    fitted, results = {}, []
    for group in dict.fromkeys(c["group"] for c in cases if c["role"] == "calibrate"):
        calibration = [c for c in cases if c["group"] == group and c["role"] == "calibrate"]
        if disaggregated(base, calibration):
            fitted[group] = fit_link(base, calibration, fitted, out_dir / "fit" / group, cfg, run_point)
        else:
            fitted[group] = fit_host(base, calibration, out_dir / "fit" / group, cfg, run_point, grid, per_seq_grid)
        log.info("%s: %s (calibration MAPE %s)", group, _knobs(fitted[group]), _pct(fitted[group]["score"]))
    for case in cases:
        if case["group"] not in fitted and case.get("calibrated_by") == PROFILE:
            knobs = {}
        else:
            fit = fitted[case["group"]] if case["group"] in fitted else fitted[case["calibrated_by"]]
            knobs = {key: fit[key] for key in FITTED if key in fit}
        run = replay(
            cfg,
            reference_file(base, case),
            base / case["setup"],
            out_dir / "cases" / case["name"],
            run_point,
            knobs=knobs,
            quiet=True,
        )
        results.append(
            {
                "name": case["name"],
                "group": case["group"],
                "calibrated_by": case.get("calibrated_by", case["group"]),
                "role": case["role"],
                "knobs": knobs,
                "rows": run["rows"],
                "notes": run["notes"],
                "headline": headline(run["rows"]),
            }
        )
    summary = {
        "fitted": fitted,
        "cases": results,
        "held_out": table_mape(
            [r for r in results if r["role"] == "held_out"],
            ("ttft", "tpot", "e2e", "requests_per_s", "output_tokens_per_s"),
        ),
        "calibration": table_mape([r for r in results if r["role"] == "calibrate"]),
        # the held-out cases of groups that borrowed another's fit (another GPU, model or degree)
        "held_out_elsewhere": table_mape(
            [r for r in results if r["role"] == "held_out" and r["calibrated_by"] != r["group"]],
            ("ttft", "tpot", "e2e", "requests_per_s", "output_tokens_per_s"),
        ),
        "pairs": pair_rows(results, load_pairs(manifest), pair_figures(manifest)),
        "held_out_by_group": {
            group: table_mape([r for r in results if r["role"] == "held_out" and r["group"] == group])
            for group in dict.fromkeys(r["group"] for r in results if r["role"] == "held_out")
        },
    }
    write_json(out_dir / "validation.json", summary)
    write_text(out_dir / "validation.md", markdown(summary))
    return summary


def disaggregated(base: Path, calibration: list[dict]) -> bool:
    return any(load_setup(base / c["setup"]).get("policy") == "disagg" for c in calibration)


def fit_host(base: Path, calibration: list[dict], out: Path, cfg, run_point, grid, per_seq_grid) -> dict:
    """The host terms of a group of colocated or chunked setups (the module's docstring)."""
    scores = {}
    for fixed in grid:
        for per_seq in per_seq_grid:
            knobs = {"host_overhead_s": fixed, "host_overhead_per_seq_s": per_seq, "frontend_latency_s": 0.0}
            where = out / f"{fixed * 1000:g}ms_{per_seq * 1e6:g}us"
            runs = [_rows(base, c, where, cfg, run_point, knobs) for c in calibration]
            frontend, score = fit_frontend(runs)
            scores[(fixed, per_seq)] = {"frontend_latency_s": frontend, "score": score}
    best = fit_overhead(scores)
    return {
        "host_overhead_s": best[0],
        "host_overhead_per_seq_s": best[1],
        "frontend_latency_s": scores[best]["frontend_latency_s"] if best in scores else 0.0,
        "score": (scores.get(best) or {}).get("score"),
        "scores": [{"host_overhead_s": k[0], "host_overhead_per_seq_s": k[1], **v} for k, v in scores.items()],
    }


def fit_link(base: Path, calibration: list[dict], fitted: dict, out: Path, cfg, run_point) -> dict:
    """A disaggregated group's hand-off path on its calibration cases, at the host terms of the
    group they name in calibrated_by (fitted before them in the manifest)."""
    source = calibration[0]["calibrated_by"]  # a group fitted before it (load_manifest)
    host = {key: fitted[source][key] for key in HOST}
    scores = {}
    for gbps in LINK_GRID_GBPS:
        for latency in LINK_GRID_LATENCY_S:
            knobs = {**host, "internode_gbps": gbps, "internode_latency_s": latency}
            where = out / f"{gbps:g}GBps_{latency * 1000:g}ms"
            errors = [mape(_rows(base, c, where, cfg, run_point, knobs)) for c in calibration]
            errors = [e for e in errors if e is not None]
            scores[(gbps, latency)] = sum(errors) / len(errors) if errors else None
    scored = [(key, score) for key, score in scores.items() if score is not None]
    (gbps, latency), score = min(scored, key=lambda item: (item[1], -item[0][0], item[0][1]))
    return {
        **host,
        "internode_gbps": gbps,
        "internode_latency_s": latency,
        "host_from": source,
        "score": score,
        "scores": [{"internode_gbps": k[0], "internode_latency_s": k[1], "score": v} for k, v in scores.items()],
    }


def _rows(base: Path, case: dict, where: Path, cfg, run_point, knobs: dict) -> list[dict]:
    return replay(
        cfg, reference_file(base, case), base / case["setup"], where / case["name"], run_point, knobs=knobs, quiet=True
    )["rows"]


def _pct(value: Optional[float]) -> str:
    return "-" if value is None else f"{100 * value:+.1f}%"


def _knobs(knobs: dict) -> str:
    """The fitted terms, short: '2 ms + 50 us/seq, front end 10 ms[, link 0.3 GB/s + 5 ms]'."""
    fixed, per_seq, front = (knobs.get(k) for k in HOST)
    text = "table" if fixed is None else f"{fixed * 1000:g} ms"
    if per_seq:
        text += f" + {per_seq * 1e6:g} us/seq"
    text += f", front end {front * 1000:g} ms" if front else ""
    gbps, latency = (knobs.get(k) for k in LINK)
    return text + (f", link {gbps:g} GB/s + {latency * 1000:g} ms" if gbps is not None else "")


def markdown(summary: dict) -> str:
    """The per-case table of docs/validation.md: real, sim and error of each published figure."""
    lines = ["| case | role | host terms | figure | real | sim | error |", "|---|---|---|---|---|---|---|"]
    for case in summary["cases"]:
        for row in case["rows"]:
            if row["real"] is None:
                continue
            scale = 1.0 if row["figure"].startswith("throughput") else 1000.0
            sim = "-" if row["sim"] is None else f"{row['sim'] * scale:.2f}"
            lines.append(
                f"| {case['name']} | {case['role']} | {_knobs(case['knobs'])} | {row['figure']} "
                f"| {row['real'] * scale:.2f} | {sim} | {_pct(row['error'])} |"
            )
    lines += ["", "| set | figure | MAPE | cases |", "|---|---|---|---|"]
    for role in ("calibration", "held_out", "held_out_elsewhere"):
        for key, value in summary.get(role, {}).items():
            mape_text = "-" if value["mape"] is None else f"{100 * value['mape']:.1f}%"
            lines.append(f"| {role} | {key} | {mape_text} | {value['cases']} |")
    lines += ["", "| held-out group | figure | MAPE | cases |", "|---|---|---|---|"]
    for group, figures in (summary.get("held_out_by_group") or {}).items():
        for key, value in figures.items():
            mape_text = "-" if value["mape"] is None else f"{100 * value['mape']:.1f}%"
            lines.append(f"| {group} | {key} | {mape_text} | {value['cases']} |")
    return "\n".join(lines + pairs_markdown(summary.get("pairs") or [])) + "\n"


def pairs_markdown(rows: list[dict]) -> list[str]:
    """The P/D pairs' differences (ms; throughput per second): real, simulated, the sign, the error."""
    if not rows:
        return []
    lines = ["", "| disagg - colocated | figure | real | sim | sign | error |", "|---|---|---|---|---|---|"]
    for row in rows:
        scale = 1 if row["figure"].startswith("throughput") else 1000  # rates per second; latencies in ms
        lines.append(
            f"| {row['disagg']}{'' if row['held_out'] else ' (calibrated)'} | {row['figure']} "
            f"| {scale * row['real']:+.2f} | {scale * row['sim']:+.2f} "
            f"| {'same' if row['same_sign'] else 'WRONG'} | {_pct(row['error'])} |"
        )
    for label, subset in (("held-out pairs", [r for r in rows if r["held_out"]]), ("all pairs", rows)):
        within = sum(r["within"] for r in subset)
        signed = sum(r["same_sign"] for r in subset)
        lines.append(
            f"\n{label}: {signed} of {len(subset)} differences of the right sign, {within} also within "
            f"{PAIR_BOUND:.0%} of the real one"
        )
    return lines


def _grid(text: Optional[str], per_second: float, default: tuple) -> tuple:
    """A comma-separated grid in ms or us as seconds (None: the default)."""
    return default if text is None else tuple(float(v) / per_second for v in text.split(","))


def main(argv=None) -> int:
    from testbed.config import Config as Root
    from testbed.config import with_overrides
    from testbed.studies.runner import run_point

    parser = argparse.ArgumentParser(
        prog="python -m testbed.studies.validation_set",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("manifest", help="the validation set's cases.yaml")
    parser.add_argument("--out", default="outputs/validation_set", help="where the runs and tables go")
    parser.add_argument("--host-grid-ms", default=None, help="the per-step host times tried, ms (e.g. 0,2,4)")
    parser.add_argument("--per-seq-grid-us", default=None, help="the per-sequence host times tried, us (e.g. 0,50)")
    parser.add_argument("--only", default=None, help="only the groups whose name starts with this (e.g. vllm0151)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("testbed.sim").setLevel(logging.WARNING)
    cfg = with_overrides(Root(), {"experiment.name": "replay", "experiment.repeats": 1})
    grid = _grid(args.host_grid_ms, 1e3, HOST_GRID_S)
    per_seq = _grid(args.per_seq_grid_us, 1e6, PER_SEQ_GRID_S)
    summary = validate(args.manifest, args.out, cfg, run_point, grid, per_seq, only=args.only)
    print(markdown(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
