"""python -m analysis RESULTS_DIR [RESULTS_DIR ...]: regenerate the figures of a study's sweep
directory (sweep.json), of one run (summary.json), or of a Hydra multirun directory (its jobs
merged into <multirun>/merged, analysis/multirun.py) from the saved results.

python -m analysis compare RUN_A RUN_B [--out DIR]: how run B differs from run A, per
configuration and figure, paired by seed where the runs share seeds (analysis/compare.py)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from analysis.load import is_run, is_sweep, load_sweep
from analysis.multirun import is_multirun, merge
from analysis.standard_figures import run_figures, study_figures
from testbed.errors import TestbedError


def figures_for(directory: Path, strict: bool) -> list[Path]:
    if is_multirun(directory):
        study, merged = merge(directory)
        return study_figures(study, merged, strict=strict)
    if is_sweep(directory):
        return study_figures(load_sweep(directory).experiment, directory, strict=strict)
    if is_run(directory):
        return run_figures(directory, strict=strict)
    raise SystemExit(f"error: {directory} is neither a sweep (sweep.json) nor a run (summary.json)")


def compare_main(argv: list[str]) -> int:
    from analysis import compare

    parser = argparse.ArgumentParser(
        prog="python -m analysis compare", description=compare.__doc__.splitlines()[0].split(": ", 1)[1]
    )
    parser.add_argument("run_a", type=Path, help="a study's directory (sweep.json) or a run's (summary.json)")
    parser.add_argument("run_b", type=Path, help="the same for the run compared with it (differences are B - A)")
    parser.add_argument("--out", type=Path, default=Path("compare"), help="where compare.json and the figure go")
    parser.add_argument(
        "--figures", default=",".join(compare.FIGURES), help="comma-separated sweep columns (goodput is always in)"
    )
    args = parser.parse_args(argv)
    try:
        lines = compare.main(args.run_a, args.run_b, args.out, tuple(f for f in args.figures.split(",") if f))
    except TestbedError as error:
        print(f"error: {error}", file=sys.stderr)
        return error.exit_code
    print("\n".join(lines))
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["compare"]:
        return compare_main(argv[1:])
    parser = argparse.ArgumentParser(
        prog="python -m analysis",
        description=__doc__.splitlines()[0],
        epilog="python -m analysis compare RUN_A RUN_B [--out DIR]: B - A per configuration (--help there)",
    )
    parser.add_argument("results_dir", nargs="+", type=Path)
    parser.add_argument("--strict", action="store_true", help="stop at the first figure that fails")
    args = parser.parse_args(argv)
    try:
        for directory in args.results_dir:
            for path in figures_for(directory, args.strict):
                print(f"figure: {path}")
    except TestbedError as error:
        print(f"error: {error}", file=sys.stderr)
        return error.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
