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
# A decode-only background, then prefills of growing length injected, per mode: the inflation (p99
# of the background's inter-token gaps that overlap a prefill over p99 of those that do not, in the
# same run) and the step-level view (decode step time with and without prefill work alongside).
#
# Results come from `python -m testbed +experiment=interference` (see `experiments/interference/README.md`);
# nothing here reruns anything. By default it reads the study's newest run: `outputs/interference/<date>/<time>/`,
# where that command writes, or `experiments/interference/results/`. Set `results_dir` below, or the
# environment variable TESTBED_RESULTS_DIR, to read another.

# %% tags=["parameters"]
from analysis import latest_results

results_dir = latest_results("interference")  # TESTBED_RESULTS_DIR, else the newest run
write_figures = False  # True: also write PDF/PNG/caption files into <results_dir>/figures/

# %%
import pandas as pd
from IPython.display import Image, display

from analysis import load_sweep, style
from analysis.standard_figures import draw, study_figures

sweep = load_sweep(results_dir)
sweep.summary("itl_p99", "decode_stalls")

# %% [markdown]
# ## Inflation and the step-level view per mode and injected length (length 0: the decode-only baseline)

# %%
pd.DataFrame([{"label": label, "prefill_len": int(n), **entry}
              for label, by_length in sweep.aggregate["interference"].items() for n, entry in by_length.items()])

# %% [markdown]
# ## Every standard figure of the study, with its caption
#
# Each figure draws every cell (a point's `experiment.repeats` runs together) with its 95% interval:
# a shaded band along a line, error bars on bars and markers. A caption names a leader only when its
# interval clears the runner-up's.

# %%
with style.paper():
    made = draw("interference", sweep)
    for stem, fig, caption, _ in made:
        print(stem)
        display(Image(style.png(fig)))
        print(caption)

# %%
if write_figures:
    for path in study_figures("interference", results_dir):
        print(path)

# %% [markdown]
# ## What the figures plotted
#
# `plotted[stem]`: exactly the values each figure drew, bounds included, in the units on its axes
# (the notebook tests hold them to sweep.json and intervals.parquet).

# %%
plotted = {stem: data for stem, _, _, data in made}
