"""Paper figures from saved results, without rerunning anything.

    load          results directories -> DataFrames (load_run, load_sweep, load_runs, point_itls);
                  latest_results(study): the newest run of a study (what its notebook reads)
                  Sweep.cells(): one row per cell (a point's repeats) with 95% intervals
    figures       one function per figure: figure(ax, data) draws, bounds included, and returns
                  what it plotted
    bars          bar figures with error bars (re-exported by figures)
    interference  the interference study's two panels (re-exported by figures)
    system        request timeline, GPU telemetry, KV bandwidth (re-exported by figures)
    bounds        error bars and bands drawn from an interval's bounds
    captions      caption text whose numbers come from the plotted data
    style         the paper style: sizes, one colour and marker per configuration, save()
    standard_figures  study_figures(name, sweep_dir), run_figures(run_dir), draw(name, sweep);
                      MAKERS: one maker per figure, by name
    plotted       what figures plotted, as JSON (a notebook's `plotted`)
    compare       B - A between two runs per configuration, paired by seed where they share seeds

`python -m analysis RESULTS_DIR` regenerates the figures of a sweep or of one run;
`python -m analysis compare RUN_A RUN_B` compares two runs.
"""

from analysis.load import Sweep, latest_results, load_run, load_runs, load_sweep, point_itls, served

__all__ = ["Sweep", "latest_results", "load_run", "load_runs", "load_sweep", "point_itls", "served"]
