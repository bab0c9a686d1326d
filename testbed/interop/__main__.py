"""python -m testbed.interop {export,import,add} ...

    export POINT_DIR [--tokenizer DIR] [--out DIR]      what a point ran, for vLLM and SGLang to replay
    import {vllm,sglang,inference-perf,guidellm} FILE OUT_DIR [--slo-ttft S] [--slo-tpot S] [--run N] [--trace F]
                                                        their run as a results directory (inference-perf's
                                                        lifecycle-metrics JSON and GuideLLM's report: summary-only)
    add SWEEP_DIR RUN --label L [--rate R] [--num-gpus N] [--format F] [--trace F] [--no-figures]
                                                        a run drawn beside a study's configurations

Bad input is one line `error: ...` and exit status 2.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional

from testbed.errors import TestbedError
from testbed.metrics.config import SLOConfig


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="python -m testbed.interop", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    commands = top.add_subparsers(dest="command", required=True)
    export = commands.add_parser("export", help="a point's traffic as a Mooncake trace and a vLLM custom dataset")
    export.add_argument("point_dir")
    export.add_argument("--tokenizer", help="a Hugging Face tokenizer directory (for vLLM's text prompts)")
    export.add_argument("--out", help="where to write (default: POINT_DIR/exports)")
    imports = commands.add_parser(
        "import", help="a vLLM, SGLang, inference-perf or GuideLLM result file as a results directory"
    )
    imports.add_argument("format", choices=["vllm", "sglang", "inference-perf", "guidellm"])
    imports.add_argument("file")
    imports.add_argument("out_dir")
    imports.add_argument("--slo-ttft", type=float, default=SLOConfig.ttft_s, help="TTFT SLO in seconds")
    imports.add_argument("--slo-tpot", type=float, default=SLOConfig.tpot_s, help="TPOT SLO in seconds")
    add = commands.add_parser("add", help="draw a run beside a study sweep's configurations")
    add.add_argument("sweep_dir")
    add.add_argument("source", metavar="RUN", help="a vLLM or SGLang result file, or a testbed results directory")
    add.add_argument("--label", required=True)
    add.add_argument("--rate", type=float, help="the request rate it was offered (rate studies)")
    add.add_argument("--num-gpus", type=int, default=1)
    add.add_argument("--format", choices=["vllm", "sglang", "testbed"], help="default: told from the file")
    add.add_argument("--no-figures", action="store_true")
    for command in (imports, add):
        command.add_argument(
            "--run",
            dest="run_index",
            metavar="N",
            type=int,
            default=-1,
            help="which run of a file holding several (default: the last)",
        )
        command.add_argument("--trace", help="the Mooncake trace the run replayed (its arrival times)")
        command.add_argument("--slowdown", type=float, default=1.0, help="the replay's --mooncake-slowdown-factor")
    return top


def export(args) -> None:
    from testbed.interop.exchange import export_point, load_decode

    decode, vocab = load_decode(args.tokenizer) if args.tokenizer else (None, None)
    done = export_point(args.point_dir, args.out, decode, vocab)
    for path in done["files"]:
        print(f"wrote {path}")
    for note in done["notes"]:
        print(f"note: {note}")
    print("replay:\n  " + "\n  ".join(done["commands"]))


def import_file(args) -> None:
    from testbed.interop.exchange import import_run

    slo = SLOConfig(ttft_s=args.slo_ttft, tpot_s=args.slo_tpot).validate()
    done = import_run(
        args.file,
        args.out_dir,
        fmt=args.format.replace("-", "_"),
        slo=slo,
        run=args.run_index,
        trace=args.trace,
        slowdown=args.slowdown,
    )
    counts = done["summary"]["num_requests"]
    if done["summary"].get("summary_only"):
        failed = counts["failed"] if counts.get("failed_known", True) else "unknown"
        print(
            f"wrote {done['dir']}: a summary-only point (the file has no per-request lists): {counts['ok']} "
            f"completed, {failed} failed; its TTFT/TPOT/ITL/E2E figures and throughput, no SLO attainment"
        )
        return
    print(
        f"wrote {done['dir']}: {counts['ok']} ok, {counts['failed']} failed of {counts['total']}; "
        f"arrivals {done['meta']['arrivals']}; SLO attainment {done['summary']['slo_attainment']}"
    )


def add(args) -> None:
    # an entry point, on top of the layers like python -m testbed: it runs the studies layer (which
    # draws through the analysis layer's entry point)
    from testbed.studies.merge import add_point

    knobs = {"num_gpus": args.num_gpus, **({"rate": args.rate} if args.rate is not None else {})}
    done = add_point(
        args.sweep_dir,
        args.source,
        label=args.label,
        knobs=knobs,
        fmt=args.format,
        trace=args.trace,
        slowdown=args.slowdown,
        run_index=args.run_index,
        figures=not args.no_figures,
    )
    print(
        f"added {done['dir']}; rewrote sweep.parquet, sweep.json, intervals.parquet"
        + (f" and {len(done['figures'])} figure files" if done["figures"] else "")
    )


def main(argv: Optional[list[str]] = None) -> int:
    args = parser().parse_args(argv)
    try:
        {"export": export, "import": import_file, "add": add}[args.command](args)
    except TestbedError as error:
        print(f"error: {str(error).splitlines()[0]}", file=sys.stderr)
        return error.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
