"""Paper figures from saved results, without rerunning anything.

    load      results directories -> DataFrames (load_run, load_sweep, load_runs, point_itls)
    figures   one function per figure: figure(ax, data) draws and returns what it plotted
    system    request timeline, GPU telemetry, KV bandwidth (re-exported by figures)
    captions  caption text whose numbers come from the plotted data
    style     the paper style: sizes, one colour and marker per configuration, save()
    studies   study_figures(name, sweep_dir), run_figures(run_dir)

`python -m analysis RESULTS_DIR` regenerates the figures of a sweep or of one run.
"""

from analysis.load import Sweep, load_run, load_runs, load_sweep, point_itls, served

__all__ = ["Sweep", "load_run", "load_runs", "load_sweep", "point_itls", "served"]
