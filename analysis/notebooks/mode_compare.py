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
# # mode_compare: TTFT and ITL distributions of the three modes on one workload
#
# Colocated, chunked and disaggregated serving of the same requests at one rate.
#
# Results come from `python -m testbed +experiment=mode_compare` (see `experiments/mode_compare/README.md`);
# nothing here reruns anything. By default it reads the study's newest run: `outputs/mode_compare/<date>/<time>/`,
# where that command writes, or `experiments/mode_compare/results/`. Set `results_dir` below, or the
# environment variable TESTBED_RESULTS_DIR, to read another.

# %% tags=["parameters"]
from analysis import latest_results

results_dir = latest_results("mode_compare")  # TESTBED_RESULTS_DIR, else the newest run
write_figures = False  # True: also write PDF/PNG/caption files into <results_dir>/figures/

# %%
from IPython.display import Image, display

from analysis import load_sweep, style
from analysis.standard_figures import draw, study_figures

sweep = load_sweep(results_dir)
sweep.summary("ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "slo_attainment")

# %% [markdown]
# ## Every standard figure of the study, with its caption
#
# Each figure draws every cell (a point's `experiment.repeats` runs together) with its 95% interval:
# a shaded band along a line, error bars on bars and markers. A caption names a leader only when its
# interval clears the runner-up's.

# %%
with style.paper():
    made = draw("mode_compare", sweep)
    for stem, fig, caption, _ in made:
        print(stem)
        display(Image(style.png(fig)))
        print(caption)

# %%
if write_figures:
    for path in study_figures("mode_compare", results_dir):
        print(path)

# %% [markdown]
# ## What the figures plotted
#
# `plotted[stem]`: exactly the values each figure drew, bounds included, in the units on its axes
# (the notebook tests hold them to sweep.json and intervals.parquet).

# %%
plotted = {stem: data for stem, _, _, data in made}
