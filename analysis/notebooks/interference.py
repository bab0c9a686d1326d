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
# # interference: How much does a prefill slow the running decodes?
#
# A decode-only background, then prefills of growing length injected: p99 ITL of the background
# over its decode-only baseline, per mode.
#
# Results come from `python -m testbed +experiment=interference output_dir=experiments/interference/results`
# (see `experiments/interference/README.md`); nothing here reruns anything. Set `results_dir` below,
# or the environment variable TESTBED_RESULTS_DIR, to read another run of the study.

# %% tags=["parameters"]
import os

results_dir = os.environ.get("TESTBED_RESULTS_DIR", "../../experiments/interference/results")
write_figures = False  # True: also write PDF/PNG/caption files into <results_dir>/figures/

# %%
from IPython.display import Image, display

from analysis import captions, figures, load_sweep, style
from analysis.studies import draw, study_figures

sweep = load_sweep(results_dir)
sweep.finished()[["point", "label", "prefill_len", "itl_p99", "decode_stalls"]]

# %% [markdown]
# ## p99 ITL inflation against the injected prefill length

# %%
with style.paper():
    fig, ax = style.figure()
    plotted = figures.itl_inflation(ax, sweep.aggregate["interference"])
    text = captions.itl_inflation(plotted)
    display(Image(style.png(fig)))
print(text)

# %% [markdown]
# ## Every standard figure of the study, with its caption

# %%
with style.paper():
    for stem, fig, caption in draw("interference", sweep):
        print(stem)
        display(Image(style.png(fig)))
        print(caption)

# %%
if write_figures:
    for path in study_figures("interference", results_dir):
        print(path)
