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
# # chunk_sweep: The chunk-size trade-off of chunked prefill
#
# Chunked prefill over chunk sizes (the step's token budget): TTFT against p99 ITL (Sarathi-Serve).
#
# Results come from `python -m testbed +experiment=chunk_sweep output_dir=experiments/chunk_sweep/results`
# (see `experiments/chunk_sweep/README.md`); nothing here reruns anything. Set `results_dir` below,
# or the environment variable TESTBED_RESULTS_DIR, to read another run of the study.

# %% tags=["parameters"]
import os

results_dir = os.environ.get("TESTBED_RESULTS_DIR", "../../experiments/chunk_sweep/results")
write_figures = False  # True: also write PDF/PNG/caption files into <results_dir>/figures/

# %%
from IPython.display import Image, display

from analysis import captions, figures, load_sweep, style
from analysis.studies import draw, study_figures

sweep = load_sweep(results_dir)
sweep.finished()[["point", "chunk", "ttft_p50", "ttft_p99", "itl_p99", "slo_attainment"]]

# %% [markdown]
# ## TTFT against p99 ITL, labelled by chunk size

# %%
with style.paper():
    fig, ax = style.figure()
    plotted = figures.chunk_tradeoff(ax, sweep.finished())
    text = captions.chunk_tradeoff(plotted)
    display(Image(style.png(fig)))
print(text)

# %% [markdown]
# ## Every standard figure of the study, with its caption

# %%
with style.paper():
    for stem, fig, caption in draw("chunk_sweep", sweep):
        print(stem)
        display(Image(style.png(fig)))
        print(caption)

# %%
if write_figures:
    for path in study_figures("chunk_sweep", results_dir):
        print(path)
