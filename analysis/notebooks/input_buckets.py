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
# Results come from `python -m testbed +experiment=input_buckets output_dir=experiments/input_buckets/results`
# (see `experiments/input_buckets/README.md`); nothing here reruns anything. Set `results_dir` below,
# or the environment variable TESTBED_RESULTS_DIR, to read another run of the study.

# %% tags=["parameters"]
import os

results_dir = os.environ.get("TESTBED_RESULTS_DIR", "../../experiments/input_buckets/results")
write_figures = False  # True: also write PDF/PNG/caption files into <results_dir>/figures/

# %%
from IPython.display import Image, display

from analysis import captions, figures, load_sweep, style
from analysis.studies import draw, study_figures

sweep = load_sweep(results_dir)
sweep.finished()[["point", "label"] + [c for c in sweep.table.columns if c.startswith("ttft_by_bucket_") and c.endswith(("count", "p50", "p99"))]]

# %% [markdown]
# ## p50 TTFT per input-length bucket

# %%
with style.paper():
    fig, ax = style.figure()
    plotted = figures.ttft_by_bucket(ax, sweep.finished(), "p50")
    text = captions.ttft_by_bucket(plotted, "p50")
    display(Image(style.png(fig)))
print(text)

# %% [markdown]
# ## Every standard figure of the study, with its caption

# %%
with style.paper():
    for stem, fig, caption in draw("input_buckets", sweep):
        print(stem)
        display(Image(style.png(fig)))
        print(caption)

# %%
if write_figures:
    for path in study_figures("input_buckets", results_dir):
        print(path)
