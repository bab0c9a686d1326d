"""Rewrite the README's result and its picture from one run of the main job, so the figures beside
the picture are the picture's.

    python scripts/front_page.py            # runs `python -m testbed +experiment=ratio_sweep` first
    python scripts/front_page.py RUN_DIR    # an earlier run of it (its results directory)

It copies the run's figures/goodput_per_gpu.png to docs/img/, writes the run's figures to
docs/img/goodput_per_gpu.json (what tests/repo/test_front_page.py regenerates the text from), and
replaces the README's block between the `front-page` markers and docs/main-job.md's printed
summary between the `printed` markers.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORD = ROOT / "docs/img/goodput_per_gpu.json"
STAMP = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),\d+\]")


def run_main_job() -> tuple[Path, float]:
    out = ROOT / "outputs/front_page" / dt.datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    t0 = time.monotonic()
    cmd = [sys.executable, "-m", "testbed", "+experiment=ratio_sweep", f"hydra.run.dir={out}"]
    subprocess.run(cmd, cwd=ROOT, check=True)
    return out, time.monotonic() - t0


def log_stamps(run: Path) -> tuple[dt.datetime, dt.datetime]:
    """The first and last stamped lines of the job's log."""
    stamps = [m.group(1) for line in (run / "__main__.log").read_text().splitlines() if (m := STAMP.match(line))]
    return dt.datetime.fromisoformat(stamps[0]), dt.datetime.fromisoformat(stamps[-1])


def printed_summary(run: Path) -> str:
    """What the run printed last: from the per-cell table to the results' path, paths made relative."""
    text = (run / "__main__.log").read_text()
    start = text.rfind("per cell:")
    block = text[start:] if start >= 0 else ""
    return block.replace(str(run.resolve()), "outputs/ratio_sweep/DATE/TIME").rstrip() + "\n"


def search_error(g: dict) -> str:
    """The largest over uncensored repeats of the crossing's uncertainty, as % of that repeat's goodput."""
    repeats = zip(g.get("error_per_repeat", []), g.get("goodput_per_repeat", []), g.get("censoring_per_repeat", []))
    shares = [e / v for e, v, censored in repeats if not censored and v]
    return f"{max(shares):.1%}" if shares else "- (a bound)"


def record_of(run: Path, seconds: float) -> dict:
    """The figures the front page states, from the run's sweep.json."""
    sweep = json.loads((run / "sweep.json").read_text())
    points, goodput = sweep["points"], sweep["aggregate"]["goodput"]
    stretch = [p["host_stretch"] for p in points if p.get("host_stretch") is not None]
    load = [p["host_load_1m"] for p in points if p.get("host_load_1m") is not None]
    configurations = {
        label: {k: g.get(k) for k in ("goodput_per_gpu", "goodput_per_gpu_low", "goodput_per_gpu_high")}
        | {"censored": g.get("goodput_censored", ""), "search_error": search_error(g)}
        for label, g in goodput.items()
    }
    return {
        "date": log_stamps(run)[0].date().isoformat(),
        "seconds": round(seconds),
        "runs": len(points),
        "size": sweep.get("size"),
        "contended_points": sum(bool(p.get("host_contended")) for p in points),
        "stretch_max": round(max(stretch), 2) if stretch else None,
        "load_max": round(max(load), 1) if load else None,
        "configurations": configurations,
        "verdict": sweep["aggregate"].get("best", {}).get("line", "no verdict"),
        "printed": printed_summary(run),
    }


def minutes(seconds: float) -> str:
    m, s = divmod(round(seconds), 60)
    return f"{m} min {s} s" if m else f"{s} s"


def goodput_text(c: dict) -> str:
    if c["censored"]:
        return f"{'>=' if c['censored'] == 'above' else '<'} {c['goodput_per_gpu']:.0f} (a bound)"
    low, high = c["goodput_per_gpu_low"], c["goodput_per_gpu_high"]
    interval = f" [{low:.0f}, {high:.0f}]" if low is not None and high is not None else ""
    return f"{c['goodput_per_gpu']:.0f}{interval}"


def host_text(r: dict) -> str:
    if r["contended_points"]:
        return f"{r['contended_points']} of {r['runs']} runs on a contended host (stretch up to x{r['stretch_max']})"
    return f"the host quiet (load at most {r['load_max']}, stretch at most x{r['stretch_max']})"


def front_page_block(r: dict) -> str:
    """The README's lines between the markers, from the record alone."""
    order = sorted(r["configurations"].items(), key=lambda kv: -kv[1]["goodput_per_gpu"])
    rows = [f"| {label} | {goodput_text(c)} | {c['search_error']} |" for label, c in order]
    return "\n".join(
        [
            f"The run behind the picture: {r['date']}, {r['runs']} runs, {host_text(r)}. "
            "Goodput per GPU, req/s [95% interval over three repeats]:",
            "",
            "| configuration | goodput per GPU | search error |",
            "|---|---|---|",
            *rows,
            "",
            f"Its last line: *{r['verdict']}*",
        ]
    )


def replace_between(text: str, name: str, body: str) -> str:
    pattern = re.compile(rf"(<!-- {name}:start -->\n).*?(<!-- {name}:end -->)", re.S)
    if not pattern.search(text):
        raise SystemExit(f"no <!-- {name}:start --> ... <!-- {name}:end --> block to rewrite")
    return pattern.sub(lambda m: m.group(1) + body + "\n" + m.group(2), text)


TIME_ROW = re.compile(r"^\| the main job \(CPU sizing\) \|.*$", re.M)


def time_row(r: dict) -> str:
    """The README's Times row of the main job: the run behind the picture."""
    return f"| the main job (CPU sizing) | {minutes(r['seconds'])} | the run behind the picture, {r['date']} |"


def rewrite(record: dict, root: Path = ROOT) -> None:
    readme, main_job = root / "README.md", root / "docs/main-job.md"
    text = replace_between(readme.read_text(), "front-page", front_page_block(record))
    if not TIME_ROW.search(text):
        raise SystemExit("README.md: no '| the main job (CPU sizing) |' row in its Times table")
    readme.write_text(TIME_ROW.sub(lambda _: time_row(record), text))
    printed = "```\n" + record["printed"] + "```"
    main_job.write_text(replace_between(main_job.read_text(), "printed", printed))


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise SystemExit("usage: python scripts/front_page.py [RUN_DIR]  (a results directory of the main job)")
    run, seconds = (Path(argv[0]), None) if argv else run_main_job()
    if not (run / "sweep.json").is_file():
        raise SystemExit(f"{run}: no sweep.json; give the results directory of a finished main job")
    if seconds is None:  # not timed here: the log's span, which leaves out the imports before its first line
        first, last = log_stamps(run)
        seconds = (last - first).total_seconds()
    record = record_of(run, seconds)
    shutil.copyfile(run / "figures/goodput_per_gpu.png", ROOT / "docs/img/goodput_per_gpu.png")
    RECORD.write_text(json.dumps(record, indent=1) + "\n")
    rewrite(record)
    print(f"README and docs/main-job.md rewritten from {run} ({record['date']}, {minutes(record['seconds'])})")


if __name__ == "__main__":
    main(sys.argv[1:])
