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
# # burstiness: SLO attainment under bursty arrivals
#
# Gamma arrivals at a fixed mean rate; burstiness 1 is Poisson, below 1 burstier.
#
# Results come from `python -m testbed +experiment=burstiness output_dir=experiments/burstiness/results`
# (see `experiments/burstiness/README.md`); nothing here reruns anything. Set `results_dir` below,
# or the environment variable TESTBED_RESULTS_DIR, to read another run of the study.

# %% tags=["parameters"]
import os

results_dir = os.environ.get("TESTBED_RESULTS_DIR", "../../experiments/burstiness/results")
write_figures = False  # True: also write PDF/PNG/caption files into <results_dir>/figures/

# %%
from IPython.display import Image, display

from analysis import captions, figures, load_sweep, style
from analysis.studies import draw, study_figures

sweep = load_sweep(results_dir)
sweep.finished()[["point", "label", "burstiness", "slo_attainment", "ttft_p99", "tpot_p99"]]

# %% [markdown]
# ## SLO attainment against burstiness

# %%
with style.paper():
    fig, ax = style.figure()
    plotted = figures.metric_by_label(ax, sweep.finished(), "burstiness", "slo_attainment")
    ax.set(xlabel="burstiness", ylabel="SLO attainment")
    text = captions.by_knob(plotted, "SLO attainment", "burstiness")
    display(Image(style.png(fig)))
print(text)

# %% [markdown]
# ## Every standard figure of the study, with its caption

# %%
with style.paper():
    for stem, fig, caption in draw("burstiness", sweep):
        print(stem)
        display(Image(style.png(fig)))
        print(caption)

# %%
if write_figures:
    for path in study_figures("burstiness", results_dir):
        print(path)
