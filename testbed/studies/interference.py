"""interference: how much prefills of each length slow a decoding background (ITL inflation).

A study in one module (testbed/studies/study.py): its settings, points, aggregate and figures."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from testbed.cluster.layout import cuda_count
from testbed.config import Config
from testbed.errors import ConfigError
from testbed.metrics.interference import background_gaps, decode_steps, injection_window
from testbed.metrics.uncertainty import ratio_interval
from testbed.studies.aggregates import finished, point_requests, point_steps
from testbed.studies.layouts import layouts
from testbed.studies.study import Study, positive
from testbed.studies.sweep import Point


@dataclass(frozen=True)
class Settings:
    """`experiment.own` of interference."""

    prefill_lengths: list[int] = field(
        default_factory=lambda: [512, 2048, 8192, 32768]
    )  # the injected prompts (tokens)
    # the background's output length is sized to outlast the injections, this many times the cost
    # model's estimate (a model's estimate: err long); 0 keeps workload.background_output_len
    background_margin: float = 2.0

    def validate(self) -> None:
        positive("prefill_lengths", self.prefill_lengths)
        margin = self.background_margin
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not margin >= 0:
            raise ConfigError(f"experiment.own.background_margin must be a number >= 0 (got {margin!r})")


def points(cfg: Config) -> list[Point]:
    """Per mode: the decode background alone (the baseline), then with prefills of each length,
    one at a time at evenly spaced arrivals, the background sized to keep decoding through them."""
    background = {"workload.background_output_len": background_len(cfg)}
    grid = []
    for label, overrides in layouts(cfg, list(cfg.experiment.modes)):
        base = {**overrides, **background, "workload.num_requests": 0}
        grid.append(Point(f"{label}_baseline", base, {"label": label, "mode": overrides["mode"], "prefill_len": 0}))
        for length in STUDY.own_settings(cfg).prefill_lengths:
            fixed = {
                "workload.input_len.dist": "fixed",
                "workload.input_len.mean": float(length),
                "workload.input_len.min": 1,
                "workload.input_len.max": int(length),
                "workload.arrival": "constant",
            }
            grid.append(
                Point(
                    f"{label}_prefill{length}",
                    {**overrides, **background, **fixed},
                    {"label": label, "mode": overrides["mode"], "prefill_len": length},
                )
            )
    return grid


def background_len(cfg: Config) -> int:
    """Background output tokens that outlast the injection window (num_requests / rate, arrivals
    evenly spaced): the window over the modelled decode step of the whole background on one
    worker (the device's cost model: emulated, simulated, or this CPU's shipped profile), times
    experiment.own.background_margin (0: keep the configured length); never below
    workload.background_output_len, never past the model's length."""
    w, margin = cfg.workload, float(STUDY.own_settings(cfg).background_margin)
    room = cfg.model.args().max_model_len - w.background_input_len - 8
    step = decode_step_model(cfg) if margin > 0 and w.background_requests else None
    if step is None:
        return min(w.background_output_len, room)
    window = (w.num_requests + 1) / w.rate
    tokens = w.background_output_len
    for _ in range(3):  # the step slows as the context grows: settle the fixed point
        context = w.background_requests * (w.background_input_len + tokens // 2)
        tokens = int(margin * window / step(w.background_requests, context))
    return int(min(max(tokens, w.background_output_len), room))


def decode_step_model(cfg: Config):
    """decode_seconds(batch, context) from the cost model of the device the background decodes on;
    None for real GPU runs (nothing to size from but the configured length)."""
    from testbed.model.config import preset
    from testbed.perf import cost_model
    from testbed.sim.config import shipped_profile

    hw, args = cfg.hardware, cfg.model.args()
    spec = hw.emulate_decode or hw.emulate
    if spec and hw.emulate_model:
        args = preset(hw.emulate_model)
    if not spec and cfg.executor == "sim":
        spec = cfg.sim.spec("decode") or str(shipped_profile(cfg.model.name))
    if not spec:
        shipped = shipped_profile(cfg.model.name)
        if cuda_count(hw) or not shipped.is_file():
            return None
        spec = str(shipped)
    model, _ = cost_model(spec, args, dtype_bytes=2)
    return lambda batch, context: model.step_time(0, 0.0, batch, context)


def aggregate(table, cfg, out_dir) -> dict:
    """Per mode and prefill length (repeats pooled): p99 ITL of background gaps that overlap an
    injected prefill against those that do not, in the same run (`inflation`), and against the
    decode-only baseline point (`inflation_vs_baseline`), with 95% intervals over the runs; decode
    stalls; and the step-level view, decode step time with and without prefill work alongside."""
    out = {}
    for label, group in finished(table).groupby("label"):
        rows = lambda r: r.sort_values("repeat") if "repeat" in r.columns else r  # noqa: E731
        loaded = {
            int(length): [(point_requests(out_dir, p, cfg), point_steps(out_dir, p)) for p in rows(g)["point"]]
            for length, g in group.groupby("prefill_len")
        }
        if 0 not in loaded:
            continue
        out[label] = {}
        for length, runs in sorted(loaded.items()):
            windows = [injection_window(requests) for requests, _ in runs]
            window = _widest(windows)
            gaps = [background_gaps(r, s, w) for (r, s), w in zip(runs, windows)]
            steps = pd.concat([decode_steps(r, s, w) for (r, s), w in zip(runs, windows)], ignore_index=True)
            # the baseline over the same period of its own run: the background alone, context grown alike;
            # run i of the baseline shares its seed with run i here (both in repeat order)
            baseline = [background_gaps(r, s, window)["itl"].to_numpy(float) for r, s in loaded[0]]
            itl = np.concatenate(baseline) if baseline else np.array([])
            threshold = cfg.metrics.stall_factor * float(np.median(itl)) if itl.size else np.nan
            out[label][str(length)] = _cell(gaps, steps, baseline, threshold)
    return {"interference": out, "baseline_stall_threshold_factor": cfg.metrics.stall_factor}


def _widest(windows: list) -> tuple[float, float] | None:
    known = [w for w in windows if w is not None]
    return (min(w[0] for w in known), max(w[1] for w in known)) if known else None


def _cell(gaps: list[pd.DataFrame], steps: pd.DataFrame, baseline: list[np.ndarray], threshold: float) -> dict:
    """`gaps`: one frame per run; `baseline`: the baseline's gaps, one array per run of the same seeds."""
    exposed = [g.loc[g["exposed"].astype(bool), "itl"].to_numpy(float) for g in gaps]
    quiet = [g.loc[~g["exposed"].astype(bool), "itl"].to_numpy(float) for g in gaps]
    inflation = ratio_interval(exposed, quiet)
    versus_baseline = ratio_interval(exposed, baseline)
    pooled = {
        k: np.concatenate(v) if v else np.array([])
        for k, v in (("exposed", exposed), ("quiet", quiet), ("baseline", baseline))
    }
    p99 = lambda x: float(np.percentile(x, 99)) if x.size else np.nan  # noqa: E731
    # a loaded host can stretch the probes' prefills over the whole window (or the background's
    # start past it): then one side has no gaps, and the note says which, not a figure
    empty = [f"no {side} gaps" for side in ("exposed", "quiet") if not pooled[side].size]
    with_prefill = steps.loc[steps["with_prefill"].astype(bool), "seconds"].to_numpy(float)
    without = steps.loc[~steps["with_prefill"].astype(bool), "seconds"].to_numpy(float)
    return {
        "exposed_gaps": int(pooled["exposed"].size),
        "quiet_gaps": int(pooled["quiet"].size),
        "itl_p99_exposed": p99(pooled["exposed"]),
        "itl_p99_quiet": p99(pooled["quiet"]),
        "itl_p99_baseline": p99(pooled["baseline"]),
        "inflation": inflation.estimate,
        "inflation_low": inflation.low,
        "inflation_high": inflation.high,
        "inflation_note": empty[0] if empty else inflation.note,
        "inflation_vs_baseline": versus_baseline.estimate,
        "inflation_vs_baseline_low": versus_baseline.low,
        "inflation_vs_baseline_high": versus_baseline.high,
        "stalls": int(np.sum(pooled["exposed"] > threshold)) + int(np.sum(pooled["quiet"] > threshold)),
        "decode_step_s_with_prefill": float(with_prefill.mean()) if with_prefill.size else np.nan,
        "decode_step_s_without_prefill": float(without.mean()) if without.size else np.nan,
        "decode_steps_with_prefill": int(with_prefill.size),
    }


STUDY = Study(
    "interference",
    "how much prefills of each length slow a decoding background (ITL inflation)",
    points,
    aggregate,
    figures=("itl_inflation",),
    # probes 0.2 s apart: the background is decoding when the first arrives, on a loaded CPU too
    on_vllm=True,
    tiny=(
        "experiment.modes=[colocated,disagg]",
        "experiment.own.prefill_lengths=[256]",
        "workload.background_requests=4",
        "workload.background_output_len=48",
        "workload.num_requests=3",
        "workload.rate=5",
        "experiment.own.background_margin=1",
    ),
    keys=("modes",),
    settings=Settings,
)
