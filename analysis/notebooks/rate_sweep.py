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
# # rate_sweep: SLO attainment and goodput per mode against the request rate
#
# Each mode over a sweep of request rates on the same devices (DistServe's figure).
#
# Results come from `python -m testbed +experiment=rate_sweep output_dir=experiments/rate_sweep/results`
# (see `experiments/rate_sweep/README.md`); nothing here reruns anything. Set `results_dir` below,
# or the environment variable TESTBED_RESULTS_DIR, to read another run of the study.

# %% tags=["parameters"]
import os

results_dir = os.environ.get("TESTBED_RESULTS_DIR", "../../experiments/rate_sweep/results")
write_figures = False  # True: also write PDF/PNG/caption files into <results_dir>/figures/

# %%
from IPython.display import Image, display

from analysis import captions, figures, load_sweep, style
from analysis.studies import draw, study_figures

sweep = load_sweep(results_dir)
sweep.finished()[["point", "label", "rate", "slo_attainment", "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99"]]

# %% [markdown]
# ## SLO attainment against rate, goodput marked

# %%
with style.paper():
    fig, ax = style.figure()
    plotted = figures.attainment_vs_rate(ax, sweep.finished())
    text = captions.attainment_vs_rate(plotted, sweep.finished())
    display(Image(style.png(fig)))
print(text)

# %% [markdown]
# ## Every standard figure of the study, with its caption

# %%
with style.paper():
    for stem, fig, caption in draw("rate_sweep", sweep):
        print(stem)
        display(Image(style.png(fig)))
        print(caption)

# %%
if write_figures:
    for path in study_figures("rate_sweep", results_dir):
        print(path)
