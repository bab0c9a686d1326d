"""python -m analysis.render [STUDY ...]: the study notebooks saved with their outputs.

Each study runs at the smallest CPU size that still exercises it (SMALL, the same sizes the
test suite runs), its notebook executes top to bottom against those results, and the notebook
is written back with every table and figure in it, so a reader sees them on the repository
page without running anything. The paired `.py` files (jupytext) carry no outputs and stay as
they are. About ten minutes for all of them on two cores.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "analysis" / "notebooks"

# Every study at the smallest size that still exercises it (the test suite runs the same).
COMMON = ["hardware=cpu", "hardware.num_devices=2", "experiment.figures=false", "experiment.repeats=1",
          "experiment.search_points=1",
          "experiment.background_margin=0", "workload.num_requests=6", "slo.ttft_s=0.5", "slo.tpot_s=0.05"]
SMALL = {
    "ratio_sweep": ["experiment.rates=[20,40]"],
    "rate_sweep": ["experiment.rates=[20,40]", "experiment.modes=[chunked,disagg]"],
    "mode_compare": [],
    "slo_scale": ["experiment.modes=[colocated,disagg]"],
    "interference": ["experiment.modes=[colocated,disagg]", "experiment.prefill_lengths=[256]",
                     # probes 0.2 s apart: the background is decoding when the first arrives, on a loaded CPU too
                     "workload.background_requests=4", "workload.background_output_len=48", "workload.num_requests=3",
                     "workload.rate=5", "experiment.background_margin=1"],
    "chunk_sweep": ["experiment.chunk_sizes=[32,256]", "hardware.num_devices=1"],
    "input_buckets": ["experiment.modes=[chunked,disagg]", "workload.input_len.max=6000"],
    "burstiness": ["experiment.burstiness=[0.5,2.0]", "experiment.modes=[chunked]"],
    "multiturn": ["workload.num_requests=2", "workload.turns=3", "workload.think_time_s=0.05",
                  "experiment.modes=[chunked,disagg]", "experiment.dispatch=[kv_aware]"],
    "kv_bandwidth": ["experiment.message_mib=1"],
    "profile": ["experiment.quick_profile=true"],
    # a tiny paced run on a shared CPU exercises the study, it measures no fidelity: kept in its
    # tables however many steps overran (tests/test_experiments.py judges the pace itself)
    "sim_validate": ["experiment.rates=[20]", "experiment.modes=[chunked]", "hardware.emulate=h100_sxm",
                     "hardware.emulate_model=llama3_8b", "hardware.max_overrun_share=1"],
    "plan": ["experiment.rates=[20,80]", "experiment.chunk_sizes=[64]", "hardware.num_devices=3",
             "workload.num_requests=40"],
    # a published GPU run replayed in the simulator (its workload is the reference's, not COMMON's)
    "replay": [f"experiment.reference={ROOT / 'tests/data/replay/sglang030_a100_llama31_8b_rps4.jsonl'}",
               f"experiment.setup={ROOT / 'tests/data/replay/sglang030_a100.setup.yaml'}"],
}


def overrides(name: str, *extra: str) -> list[str]:
    return [f"+experiment={name}", *COMMON, *SMALL[name], *extra]


def run_small(name: str, out_dir: Path, *extra: str) -> dict:
    """The study at its small size into out_dir (what the notebooks and the tests read)."""
    from hydra import compose, initialize_config_dir

    from analysis.studies import study_figures
    from testbed.config import CONF_DIR, override_keys, register_configs, to_config
    from testbed.studies import figures
    from testbed.studies.runner import run

    register_configs()
    figures.draw_with(study_figures)
    chosen = overrides(name, *extra)
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        cfg = to_config(compose("config", overrides=chosen))
    return run(cfg, out_dir, override_keys(chosen))


def execute(notebook: Path, results_dir: Path):
    """The notebook executed in a fresh kernel against results_dir (its outputs filled in)."""
    import nbclient
    import nbformat

    nb = nbformat.read(notebook, as_version=4)
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "TESTBED_RESULTS_DIR": str(results_dir), "PYTHONPATH": path}
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(notebook.parent)}})
    client.execute(env=env)
    return nb


def render(name: str, scratch: Path) -> Path:
    import nbformat

    notebook = NOTEBOOKS / f"{name}.ipynb"
    results = scratch / name
    run_small(name, results)
    nb = execute(notebook, results)
    nb.metadata["rendered_from"] = f"python -m analysis.render {name} (a small CPU run: {' '.join(overrides(name))})"
    nbformat.write(nb, notebook)
    return notebook


def main(argv=None) -> int:
    studies = sorted(p.stem for p in NOTEBOOKS.glob("*.ipynb"))
    parser = argparse.ArgumentParser(prog="python -m analysis.render", description=__doc__.splitlines()[0])
    parser.add_argument("studies", nargs="*", metavar="STUDY", help=f"default: all of {', '.join(studies)}")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.studies) - set(studies))
    if unknown:
        parser.error(f"no notebook for {', '.join(unknown)}; allowed: {', '.join(studies)}")
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.studies or studies:
            print(f"rendered {render(name, Path(scratch))}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
