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
# # plan: Which P:D split should one run?
#
# The first-order analytical split, the simulated goodput per GPU of every split and chunk size,
# and, when the study was given a real ratio_sweep, the measured one beside it.
#
# Results come from `python -m testbed +experiment=plan` (see `experiments/plan/README.md`);
# nothing here reruns anything. By default it reads the study's newest run: `outputs/plan/<date>/<time>/`,
# where that command writes, or `experiments/plan/results/`. Set `results_dir` below, or the
# environment variable TESTBED_RESULTS_DIR, to read another.

# %% tags=["parameters"]
from analysis import latest_results

results_dir = latest_results("plan")  # TESTBED_RESULTS_DIR, else the newest run
write_figures = False  # True: also write PDF/PNG/caption files into <results_dir>/figures/

# %%
import pandas as pd
from IPython.display import Image, display

from analysis import load_sweep, style
from analysis.standard_figures import draw, study_figures

sweep = load_sweep(results_dir)
analytical = sweep.aggregate["analytical"]
pd.DataFrame({stat: analytical[stat] for stat in ("mean", "p95")})

# %%
columns = ["goodput", "goodput_low", "goodput_high", "goodput_per_gpu", "goodput_per_gpu_low", "goodput_per_gpu_high",
           "capacity"]
simulated = pd.DataFrame(sweep.aggregate["simulated"]["goodput"]).T.reindex(columns=columns)
simulated.sort_values("goodput_per_gpu", ascending=False)

# %% [markdown]
# ## The best simulated configuration, named only when its interval clears the runner-up's

# %%
print(sweep.aggregate["simulated"].get("best", {}).get("line", "no verdict saved"))

# %% [markdown]
# ## Every standard figure of the study, with its caption
#
# Each figure draws every cell (a point's `experiment.repeats` runs together) with its 95% interval:
# a shaded band along a line, error bars on bars and markers. A caption names a leader only when its
# interval clears the runner-up's.
#
# With `experiment.own.tp_degrees` beyond `[1]` the TP placement search adds `placement_goodput`: heat maps
# of goodput per GPU by (prefill TP, decode TP) for the disaggregated placements (each cell the best
# over worker counts, annotated with the split) and by TP for colocated and chunked.

# %%
with style.paper():
    made = draw("plan", sweep)
    for stem, fig, caption, _ in made:
        print(stem)
        display(Image(style.png(fig)))
        print(caption)

# %%
if write_figures:
    for path in study_figures("plan", results_dir):
        print(path)

# %% [markdown]
# ## What the figures plotted
#
# `plotted[stem]`: exactly the values each figure drew, bounds included, in the units on its axes
# (the notebook tests hold them to sweep.json and intervals.parquet).

# %%
plotted = {stem: data for stem, _, _, data in made}
