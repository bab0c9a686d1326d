"""Console tables at the end of a run (the results directory holds the full record), through
logging: under Hydra the job's log file keeps them beside the console."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pandas as pd

from testbed.metrics.comparisons import comparison_lines

log = logging.getLogger("testbed")


LATENCIES = ("ttft", "tpot", "itl", "e2e")  # figures in seconds in the results, shown in ms
TITLES = {"slo_attainment": "SLO attainment", "throughput_requests_per_s": "throughput req/s"}


def _ms(x) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{1000 * x:8.1f}"


def is_latency(column: str) -> bool:
    return column.split("_")[0] in LATENCIES


def title(column: str) -> str:
    """A table column's heading: what it is and its unit (`ttft_p99` -> `TTFT p99 ms`)."""
    if is_latency(column):
        metric, _, stat = column.partition("_")
        return f"{metric.upper()} {stat.replace('_', ' ')} ms".replace("  ", " ")
    return TITLES.get(column, column)


def _figure(x) -> str:
    return "-" if x is None or x != x else f"{x:.4g}"


def shown_table(table: pd.DataFrame, columns: list[str]) -> pd.DataFrame:
    """The sweep's points as printed: latencies in ms, every column headed by what it holds."""
    shown = pd.DataFrame({"point": table["point"]})
    if "status" in table:
        shown["status"] = table["status"]
    for column in columns:
        if column in table.columns:
            scale = 1000.0 if is_latency(column) else 1.0
            shown[title(column)] = [_figure(scale * v if v is not None else None) for v in table[column]]
    return shown


def request_lines(requests: pd.DataFrame, limit: int = 20) -> list[str]:
    lines = [f"{'id':>5} {'in':>6} {'out':>5} {'status':>8} {'ttft ms':>8} {'tpot ms':>8}"]
    for row in requests.head(limit).itertuples():
        lines.append(
            f"{row.request_id:>5} {row.input_len:>6} {len(row.output_token_ids):>5} {row.status:>8} "
            f"{_ms(row.ttft)} {_ms(row.tpot)}"
        )
    if len(requests) > limit:
        lines.append(f"... {len(requests) - limit} more in requests.parquet")
    return lines


def summary_lines(summary: dict) -> list[str]:
    lines = []
    for metric in ("ttft", "tpot", "itl", "e2e"):
        d = summary.get(metric) or {}
        lines.append(f"{metric:>5}  mean {_ms(d.get('mean'))}  p50 {_ms(d.get('p50'))}  p99 {_ms(d.get('p99'))} ms")
    tp = summary.get("throughput") or {}
    lines.append("throughput  " + "  ".join(f"{k} {v:.1f}" for k, v in tp.items() if isinstance(v, (int, float))))
    if "slo_attainment" in summary:
        lines.append(f"SLO attainment {summary['slo_attainment']}")
    said = host_line(summary.get("host"))
    return lines + ([said] if said else [])


def _known(x) -> bool:
    return x is not None and x == x


def host_line(host: dict | None) -> str:
    """What the host gave the run (testbed/cluster/contention.py); '' where it was not measured."""
    if not host or not _known(host.get("stretch")):
        return ""
    load, cores = host.get("load_1m_end", host.get("load_1m")), host.get("cores", "?")
    on = f"load {load:.1f} on {cores} cores" if _known(load) else f"{cores} cores"
    waited = f"the run's processes waited for a core {host['stretch'] - 1:.0%} of the time they ran"
    if host["contended"]:
        return (
            f"WARNING: contended host: {waited} (stretch x{host['stretch']:.2f} > metrics.contended_stretch="
            f"{host['threshold']:g}; {on}): these figures measure the host's other work as much as the "
            "system; rerun on a quiet host"
        )
    return f"host: not contended ({waited}, stretch x{host['stretch']:.2f}; {on})"


def print_run(requests: pd.DataFrame, summary: dict, out_dir) -> None:
    log.info("\n".join(request_lines(requests) + [""] + summary_lines(summary) + [f"results: {out_dir}"]))


def _with_interval(value, low, high, scale: float = 1.0, note: str = "", censored: str = "") -> str:
    if value is None or value != value:
        return "-"
    if censored:  # a bound: no interval, and never an exact number
        return f"{'>=' if censored == 'above' else '<'} {scale * value:.4g}"
    if note == "not estimable":
        return f"{scale * value:.4g} [not estimable]"
    if low is None or low != low:
        return f"{scale * value:.4g}"
    label = " (one run)" if note.startswith("within one run") else ""  # batches of one run, not runs
    return f"{scale * value:.4g} [{scale * low:.4g}, {scale * high:.4g}]{label}"


def cell_lines(cells: pd.DataFrame, columns: list[str]) -> list[str]:
    """One row per cell: each figure over the repeats and its 95% interval over the runs."""
    if cells is None or cells.empty:
        return []
    shown = [c for c in columns if c in cells.columns]
    table = pd.DataFrame({"cell": cells["cell"], "repeats": cells["repeats"]})
    for column in shown:
        low, high, note = (cells.get(f"{column}_{k}") for k in ("low", "high", "note"))
        at = lambda series, i: None if series is None else series.iloc[i]  # noqa: E731
        scale = 1000.0 if is_latency(column) else 1.0
        table[title(column)] = [
            _with_interval(v, at(low, i), at(high, i), scale, note=at(note, i) or "")
            for i, v in enumerate(cells[column])
        ]
    return [
        "per cell: latency percentiles and attainment of the repeats' requests pooled, other figures "
        "the mean over repeats; [95% interval over the runs]",
        table.to_string(index=False),
    ]


def capacity_text(g: dict) -> str:
    """The capacity column: the mean over repeats with its interval, or the bound the rates tried
    give (>= the highest when every rate passes, < the lowest when none does)."""
    censored = g.get("capacity_censored", "")
    if censored == "both":  # bounds both ways: nothing is known of the mean
        return "- (bounds)"
    value = g["capacity_bound"] if censored else g["capacity"]
    return _with_interval(value, g.get("capacity_low"), g.get("capacity_high"), censored=censored)


def goodput_lines(goodput: dict) -> list[str]:
    width = max([14, *map(len, goodput)])
    lines = [
        f"{'configuration':>{width}} {'goodput req/s':>24} {'goodput req/s per GPU':>24} {'search error':>12} "
        f"{'rates tried':>11} {'capacity req/s':>24}"
    ]
    for label, g in goodput.items():
        censored = g.get("goodput_censored", "")
        total = _with_interval(g["goodput"], g.get("goodput_low"), g.get("goodput_high"), censored=censored)
        per_gpu = _with_interval(
            g["goodput_per_gpu"], g.get("goodput_per_gpu_low"), g.get("goodput_per_gpu_high"), censored=censored
        )
        lines.append(
            f"{label:>{width}} {total:>24} {per_gpu:>24} {_search_error(g):>12} "
            f"{g.get('rates_tried', len(g['rates'])):>11} {capacity_text(g):>24}"
        )
    lines.append(
        "goodput: the highest rate with 90% of requests within both SLOs (DistServe); search error: the "
        "largest over repeats of how far the crossing may lie from its goodput within the fitted bracket "
        "(% of it); capacity: the highest rate whose p99 ITL stays under slo.tpot_s (Sarathi-Serve); "
        "mean over repeats [95% interval], '>=' / '<': a bound where the rates tried do not bracket it"
    )
    bent = {
        label: g["monotone_per_repeat"].count(False)
        for label, g in goodput.items()
        if False in g.get("monotone_per_repeat", [])
    }
    if bent:
        lines.append(
            "non-monotone repeats (attainment rose with rate beyond its noise; the fit pooled it): "
            + ", ".join(f"{label} {n}" for label, n in bent.items())
        )
    return lines


def _search_error(g: dict) -> str:
    pairs = [
        (e, v)
        for e, v, c in zip(
            g.get("error_per_repeat", []), g.get("goodput_per_repeat", []), g.get("censoring_per_repeat", [])
        )
        if not c and v
    ]
    return f"{max(e / v for e, v in pairs):.1%}" if pairs else "-"


def print_sweep(
    name: str,
    table: pd.DataFrame,
    aggregate: dict,
    out_dir,
    columns: list[str],
    figures,
    cells: pd.DataFrame | None = None,
) -> None:
    """The study's summary, its verdict last above the figures' and results' paths (the last lines
    on screen); the one-row-per-point table goes to points.txt beside them, named in one line."""
    points_txt = Path(out_dir) / "points.txt"
    points_txt.write_text(shown_table(table, columns).to_string(index=False) + "\n")
    lines = [f"\n{name}: {len(table)} points, one row each in {points_txt}"]
    failed = table[table["status"] == "failed"] if "status" in table else table.iloc[0:0]
    lines += [f"FAILED {row.point}: {row.error}" for row in failed.itertuples()]
    lines += cell_lines(cells, columns)
    lines += plan_lines(aggregate) + validation_lines(aggregate)
    if aggregate.get("goodput"):
        lines += goodput_lines(aggregate["goodput"])
    if aggregate.get("best"):
        lines += comparison_lines(aggregate["best"].get("comparisons", []))
    lines += overrun_lines(table) + contention_lines(table)
    if aggregate.get("best"):
        lines.append(aggregate["best"]["line"])
    lines += [f"figure: {f}" for f in figures] + [f"results: {out_dir}"]
    log.info("\n".join(lines))


def plan_lines(aggregate: dict) -> list[str]:
    if "analytical" not in aggregate:
        return []
    a, sim = aggregate["analytical"], aggregate["simulated"]
    measured = aggregate.get("measured", {})
    analytical = (
        [
            f"  analytical (p95 lengths): {a['p95']['split']}   (mean lengths: {a['mean']['split']}; "
            f"prefill share {a['p95']['prefill_share']:.2f})"
        ]
        if a
        else [f"  analytical: none ({aggregate.get('analytical_skipped', 'not planned')})"]
    )
    devices = (a or aggregate.get("slo_plan") or {}).get("num_devices", "?")
    lines = [
        f"P:D plan for {devices} devices" + (f" ({aggregate['planned_tp']})" if aggregate.get("planned_tp") else ""),
        *([f"  engine profile: {aggregate['engine']}"] if "engine" in aggregate else []),
        *analytical,
        *slo_split_lines(aggregate.get("slo_plan")),
        *([f"  SLO-aware: none ({aggregate['slo_plan_skipped']})"] if aggregate.get("slo_plan_skipped") else []),
        f"  simulated: {sim['best'].get('line', '')}",
        *placement_lines(aggregate.get("placements")),
        *why_planners_differ(aggregate),
    ]
    if measured:
        best = measured.get("best", {})
        lines.append(f"  measured: {best.get('line') or best.get('label')}")
    width = max([14, *map(len, sim["goodput"])])  # TP placements' labels are longer
    lines.append(f"  {'configuration':>{width}} {'simulated/GPU':>14} {'measured/GPU':>13}")
    for label, g in sim["goodput"].items():
        m = measured.get("goodput", {}).get(label, {}).get("goodput_per_gpu")
        lines.append(f"  {label:>{width}} {g['goodput_per_gpu']:>14.2f} {'-' if m is None else f'{m:.2f}':>13}")
    return lines


# what each planner sees, so a reader knows why their answers may part
PLANNERS = (
    ("analytical", "balances prefill against decode work per request at the p95 lengths; no queueing, no SLO"),
    ("SLO-aware", "the highest rate a split serves with each phase's queue within its SLO; no batching effects"),
    (
        "simulated",
        "every configuration stepped on the cost model, colocated and chunked too; batching and interference",
    ),
)


def why_planners_differ(aggregate: dict) -> list[str]:
    """One line per planner saying what it models, where their answers are not one split."""
    analytical = (aggregate.get("analytical") or {}).get("split")
    slo = (aggregate.get("slo_plan") or {}).get("best")
    best = (aggregate.get("simulated") or {}).get("best") or {}
    simulated = best.get("label") if best.get("separated") else None
    answers = {a for a in (analytical, slo, simulated) if a}
    if len(answers) <= 1 and simulated:
        return ["  the three planners agree"]
    return ["  why the answers may differ:", *(f"    {name}: {what}" for name, what in PLANNERS)]


def placement_lines(search: dict | None) -> list[str]:
    """The TP placement search's leader with its interval, and what it pruned."""
    if not search:
        return []
    counts = f"{len(search['searched'])} simulated, {len(search['pruned'])} pruned"
    lines = [f"  placements over TP {search['tp_degrees']}: {counts}"]
    if search["best"]:
        lines.append(
            f"  best placement: {search['best']}, {search['goodput_per_gpu']:.3g} req/s per GPU "
            f"[{search['goodput_per_gpu_low']:.3g}, {search['goodput_per_gpu_high']:.3g}]"
            + ("" if search["separated"] else " (not separated from the runner-up)")
        )
    by_reason: dict[str, list[str]] = {}
    for label, why in search["pruned"].items():
        by_reason.setdefault(why, []).append(label)
    lines += [f"    pruned {', '.join(labels)}: {why}" for why, labels in by_reason.items()]
    return lines


def slo_split_lines(plan: dict | None) -> list[str]:
    if not plan:  # a sweep saved before the SLO-aware split
        return []
    where = (
        f"{plan['num_nodes']} nodes x {plan['devices_per_node']}, P and D on different nodes"
        if plan["num_nodes"] > 1
        else "one node"
    )
    if plan["best"] is None:
        return [f"  SLO-aware ({where}): no split meets both SLOs"]
    best = plan["splits"][plan["best"]]
    return [
        f"  SLO-aware ({where}, KV hand-off {plan['transfer_s'] * 1e3:.1f} ms): {plan['best']}, "
        f"{best['max_rate']:.1f} req/s within both SLOs ({best['rate_per_device']:.2f} per device)"
    ]


def validation_lines(aggregate: dict) -> list[str]:
    if "worst_abs_error" not in aggregate:
        return []
    worst = ", ".join(f"{k} {v:.0%}" for k, v in aggregate["worst_abs_error"].items())
    goodput = ", ".join(f"{k} {v:+.0%}" for k, v in aggregate["goodput_error"].items())
    within = ", ".join(
        f"{k} {v}/{aggregate.get('points_compared', 0)}" for k, v in aggregate.get("within_real_interval", {}).items()
    )
    lines = [
        f"simulation error, worst |sim - real| / real: {worst}",
        f"goodput error per mode: {goodput}",
        f"simulated inside the real cell's 95% interval (not told apart): {within}",
    ]
    for label, d in aggregate.get("host_delays", {}).items():
        lines.append(
            f"  {label}: simulated with host delays dispatch {1000 * d['dispatch_s']:.2f} ms, step gap "
            f"{1000 * d['step_gap_s']:.2f} ms, report {1000 * d['report_s']:.2f} ms, step time "
            + ", ".join(
                f"x{v:.2f} ({k.removeprefix('step_scale_')})" for k, v in d.items() if k.startswith("step_scale_")
            )
            + " (medians)"
        )
    return lines


def overrun_lines(table: pd.DataFrame) -> list[str]:
    """The warning for emulated points whose CPU could not keep the modelled pace."""
    if "overrun" not in table.columns or not table["overrun"].fillna(False).astype(bool).any():
        return []
    dropped = table[table["overrun"].fillna(False).astype(bool)]
    return [
        f"WARNING: {len(dropped)} emulated point(s) overran their modelled step times in more than "
        f"hardware.max_overrun_share of steps and are left out of every verdict: "
        f"{', '.join(dropped['point'])}"
    ]


def contention_lines(table: pd.DataFrame) -> list[str]:
    """The warning for real points that ran on a contended host (their summary.json's `host`)."""
    if "host_contended" not in table.columns or not table["host_contended"].fillna(0).astype(bool).any():
        return []
    hit = table[table["host_contended"].fillna(0).astype(bool)]
    worst = hit["host_stretch"].max() if "host_stretch" in hit.columns else float("nan")
    return [
        f"WARNING: {len(hit)} of {len(table)} point(s) ran on a contended host (waiting for a core "
        f"stretched their processes' CPU time up to x{worst:.2f}): {', '.join(hit['point'])}"
    ]
