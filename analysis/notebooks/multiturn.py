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
# # multiturn: Multi-turn sessions: does session affinity cut TTFT?
#
# Agent sessions whose turns reuse the previous context: mean TTFT per turn with session affinity
# against round robin, per mode.
#
# Results come from `python -m testbed +experiment=multiturn output_dir=experiments/multiturn/results`
# (see `experiments/multiturn/README.md`); nothing here reruns anything. Set `results_dir` below,
# or the environment variable TESTBED_RESULTS_DIR, to read another run of the study.

# %% tags=["parameters"]
import os

results_dir = os.environ.get("TESTBED_RESULTS_DIR", "../../experiments/multiturn/results")
write_figures = False  # True: also write PDF/PNG/caption files into <results_dir>/figures/

# %%
from IPython.display import Image, display

from analysis import captions, figures, load_sweep, style
from analysis.studies import draw, study_figures

sweep = load_sweep(results_dir)
sweep.finished()[["point", "label", "dispatch", "ttft_p50", "ttft_p99", "slo_attainment"]]

# %% [markdown]
# ## Mean TTFT per turn

# %%
with style.paper():
    fig, ax = style.figure()
    plotted = figures.ttft_by_turn(ax, sweep.aggregate["turns"], sweep.finished())
    text = captions.by_knob(plotted, "mean TTFT (ms)", "turn")
    display(Image(style.png(fig)))
print(text)

# %% [markdown]
# ## Every standard figure of the study, with its caption

# %%
with style.paper():
    for stem, fig, caption in draw("multiturn", sweep):
        print(stem)
        display(Image(style.png(fig)))
        print(caption)

# %%
if write_figures:
    for path in study_figures("multiturn", results_dir):
        print(path)
