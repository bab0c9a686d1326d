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
# # slo_scale: SLO attainment as both SLOs tighten
#
# Every mode at one rate; both SLOs multiplied by a scale (DistServe's SLO-scale figure).
#
# Results come from `python -m testbed +experiment=slo_scale output_dir=experiments/slo_scale/results`
# (see `experiments/slo_scale/README.md`); nothing here reruns anything. Set `results_dir` below,
# or the environment variable TESTBED_RESULTS_DIR, to read another run of the study.

# %% tags=["parameters"]
import os

results_dir = os.environ.get("TESTBED_RESULTS_DIR", "../../experiments/slo_scale/results")
write_figures = False  # True: also write PDF/PNG/caption files into <results_dir>/figures/

# %%
from IPython.display import Image, display

from analysis import captions, figures, load_sweep, style
from analysis.studies import draw, study_figures

sweep = load_sweep(results_dir)
sweep.finished()[["point", "label", "slo_attainment", "slo_ttft_s", "slo_tpot_s"]]

# %% [markdown]
# ## Attainment against SLO scale, the tightest scale meeting 90% marked

# %%
with style.paper():
    fig, ax = style.figure()
    plotted = figures.attainment_vs_scale(ax, sweep.aggregate["curves"])
    text = captions.attainment_vs_scale(plotted)
    display(Image(style.png(fig)))
print(text)

# %% [markdown]
# ## Every standard figure of the study, with its caption

# %%
with style.paper():
    for stem, fig, caption in draw("slo_scale", sweep):
        print(stem)
        display(Image(style.png(fig)))
        print(caption)

# %%
if write_figures:
    for path in study_figures("slo_scale", results_dir):
        print(path)
