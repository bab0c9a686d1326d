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
# # input_buckets: TTFT by input length
#
# Each mode on a heavy-tailed length mix; TTFT per input-length bucket (0-1K, 1K-4K, 4K-16K, 16K+).
#
# Results come from `python -m testbed +experiment=input_buckets` (see `experiments/input_buckets/README.md`);
# nothing here reruns anything. By default it reads the study's newest run: `outputs/input_buckets/<date>/<time>/`,
# where that command writes, or `experiments/input_buckets/results/`. Set `results_dir` below, or the
# environment variable TESTBED_RESULTS_DIR, to read another.

# %% tags=["parameters"]
from analysis import latest_results

results_dir = latest_results("input_buckets")  # TESTBED_RESULTS_DIR, else the newest run
write_figures = False  # True: also write PDF/PNG/caption files into <results_dir>/figures/

# %%
from IPython.display import Image, display

from analysis import load_sweep, style
from analysis.standard_figures import draw, study_figures

sweep = load_sweep(results_dir)
sweep.ttft_buckets()

# %% [markdown]
# ## Every standard figure of the study, with its caption
#
# Each figure draws every cell (a point's `experiment.repeats` runs together) with its 95% interval:
# a shaded band along a line, error bars on bars and markers. A caption names a leader only when its
# interval clears the runner-up's.

# %%
with style.paper():
    made = draw("input_buckets", sweep)
    for stem, fig, caption, _ in made:
        print(stem)
        display(Image(style.png(fig)))
        print(caption)

# %%
if write_figures:
    for path in study_figures("input_buckets", results_dir):
        print(path)

# %% [markdown]
# ## What the figures plotted
#
# `plotted[stem]`: exactly the values each figure drew, bounds included, in the units on its axes
# (the notebook tests hold them to sweep.json and intervals.parquet).

# %%
plotted = {stem: data for stem, _, _, data in made}
