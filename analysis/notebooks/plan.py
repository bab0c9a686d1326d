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
# Results come from `python -m testbed +experiment=plan output_dir=experiments/plan/results`
# (see `experiments/plan/README.md`); nothing here reruns anything. Set `results_dir` below,
# or the environment variable TESTBED_RESULTS_DIR, to read another run of the study.

# %% tags=["parameters"]
import os

results_dir = os.environ.get("TESTBED_RESULTS_DIR", "../../experiments/plan/results")
write_figures = False  # True: also write PDF/PNG/caption files into <results_dir>/figures/

# %%
import pandas as pd
from IPython.display import Image, display

from analysis import load_sweep, style
from analysis.studies import draw, study_figures

sweep = load_sweep(results_dir)
analytical = sweep.aggregate["analytical"]
pd.DataFrame({stat: analytical[stat] for stat in ("mean", "p95")})

# %%
simulated = pd.DataFrame(sweep.aggregate["simulated"]["goodput"]).T[["goodput", "goodput_per_gpu", "capacity"]]
simulated.sort_values("goodput_per_gpu", ascending=False)

# %% [markdown]
# ## Every standard figure of the study, with its caption

# %%
with style.paper():
    for stem, fig, caption in draw("plan", sweep):
        print(stem)
        display(Image(style.png(fig)))
        print(caption)

# %%
if write_figures:
    for path in study_figures("plan", results_dir):
        print(path)
