# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # concurrency_sweep: throughput and latency per mode against the number of closed-loop users
#
# Each mode under a closed loop of N users (each sends its next request when its last one ends), over a sweep of N.
#
# Results come from `python -m testbed +experiment=concurrency_sweep` (see `experiments/concurrency_sweep/README.md`);
# nothing here reruns anything. By default it reads the study's newest run: `outputs/concurrency_sweep/<date>/<time>/`,
# where that command writes, or `experiments/concurrency_sweep/results/`. Set `results_dir` below, or the
# environment variable TESTBED_RESULTS_DIR, to read another.

# %% tags=["parameters"]
from analysis import latest_results

results_dir = latest_results("concurrency_sweep")  # TESTBED_RESULTS_DIR, else the newest run
write_figures = False  # True: also write PDF/PNG/caption files into <results_dir>/figures/

# %%
from IPython.display import Image, display

from analysis import load_sweep, style
from analysis.standard_figures import draw, study_figures

sweep = load_sweep(results_dir)
sweep.summary("throughput_requests_per_s", "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99")

# %% [markdown]
# ## The best configuration, named only when its interval clears the runner-up's

# %%
print(sweep.aggregate.get("best", {}).get("line", "no verdict saved"))

# %% [markdown]
# ## Every standard figure of the study, with its caption
#
# Each figure draws every cell (a point's `experiment.repeats` runs together) with its 95% interval:
# a shaded band along a line, error bars on bars and markers. A caption names a leader only when its
# interval clears the runner-up's.

# %%
with style.paper():
    made = draw("concurrency_sweep", sweep)
    for stem, fig, caption, _ in made:
        print(stem)
        display(Image(style.png(fig)))
        print(caption)

# %%
if write_figures:
    for path in study_figures("concurrency_sweep", results_dir):
        print(path)

# %% [markdown]
# ## What the figures plotted
#
# `plotted[stem]`: exactly the values each figure drew, bounds included, in the units on its axes
# (the notebook tests hold them to sweep.json and intervals.parquet).

# %%
plotted = {stem: data for stem, _, _, data in made}
