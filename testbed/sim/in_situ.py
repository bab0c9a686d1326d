"""A profile fitted in situ: from a real run's own results, under its real process layout.

`sim.profile=run:<results dir>` simulates on what that run measured rather than on a profile
taken by `+experiment=profile` on a quiet engine in one process: every step's wall time with
the worker processes and the router sharing the machine (contention included), the KV
transfers as they went, and the host-side delays the cost model cannot see:

    release      arrival -> dispatched: the router's lateness letting a request in
    dispatch     router -> worker: dispatched -> the first step holding the request, over the
                 requests that reached an idle worker (so no step was in the way)
    step_gap     a worker's gap between a step and the next when work was waiting: its report,
                 inbox and KV polling (after a step that prefilled apart: step_gap_prefill)
    report       a token stamped on the worker -> read by the router (the harness delay); a
                 request's first token apart (report_first: about twice the others' here)
    handoff      P's first token stamped -> its KV transfer's start (disagg: bind, Reserve,
                 Ready, P between its steps)
    transfer_scale  real KV transfer time / the fitted link's time for its bytes: both ends must
                 be on a core at once, so a loaded run's transfers have a tail (p99 6-10x the
                 median here) that a latency-and-bandwidth fit alone gives every transfer's median
    step_scale   real step time / the fitted model's time for its shape: contention (for decode
                 steps and for steps with prefill apart: the linear fit errs differently on each)

each kept as a distribution (testbed/sim/host.py), so the tails come through as well as the medians.

Steps are fitted per role where the run has that role (P's and D's contention differ).
sim_validate calibrates on real runs of its own (other seeds), never on the runs it validates.
"""

from __future__ import annotations

import glob
from pathlib import Path
from statistics import NormalDist
from typing import Optional

import numpy as np
import pandas as pd

from testbed.control.config import RENAMED_BACKENDS
from testbed.errors import ConfigError
from testbed.metrics.results_dir import read_results
from testbed.model.config import ModelConfig
from testbed.perf.attention import attended_context
from testbed.perf.measured import (
    SHAPE_KEYS,
    STEP_INPUTS,
    STEP_TERMS,
    TRANSFER_TERMS,
    fit_transfer,
    link_time,
    relative_fit,
    step_features,
)
from testbed.sim.host import Delay

PREFIX = "run:"
ROLES = {"mixed": ("colocated", "chunked"), "prefill": ("prefill_only",), "decode": ("decode_only",)}
MIN_STEPS = 10
RUN_STRIDE = 1_000_000  # pooled runs' worker and request ids: run k's are offset by k x this


def is_run_spec(spec: Optional[str]) -> bool:
    return spec is not None and spec.startswith(PREFIX)


def load_in_situ(spec: str, role: str, key: str = "sim.profile") -> dict:
    """The profile a role simulates on, fitted from the run `spec` names (run:<dir>), or from the
    runs a glob names (run:<dir>_r*: repeats, pooled)."""
    results = read_runs(spec, key)
    steps = results["steps"]
    own = steps[steps["role"].isin(ROLES[role])]
    workers = results["summary"].get("workers") or {}
    device = next((w["device"] for w in workers.values()), "cpu").split(":")[0]
    return profile_from_results(
        results["config"],
        device,
        own if len(own) >= MIN_STEPS else steps,
        steps,
        results["kv_transfers"],
        results["requests"],
        f"{key}={spec}",
    )


def read_runs(spec: str, key: str) -> dict:
    """The results of the run(s) `spec` names; several are pooled, each run's workers and requests
    renumbered apart so that every worker's timeline stays whole."""
    pattern = spec[len(PREFIX) :]
    directories = sorted(Path(p) for p in glob.glob(pattern)) if glob.has_magic(pattern) else [Path(pattern)]
    unfinished = [str(d) for d in directories if not (d / "summary.json").is_file()]
    if not directories or unfinished:
        raise ConfigError(
            f"{key}={spec!r}: {', '.join(unfinished) or 'the pattern'} is not a finished run's "
            f"results directory (run:<dir>, or run:<glob> matching several)"
        )
    runs = [read_results(d) for d in directories]
    if len(runs) == 1:
        return runs[0]
    return {
        "config": runs[0]["config"],
        "summary": runs[0]["summary"],
        "steps": pd.concat([_apart(r["steps"], k, ["worker"]) for k, r in enumerate(runs)], ignore_index=True),
        "requests": pd.concat(
            [_apart(r["requests"], k, ["request_id", "prefill_worker", "decode_worker"]) for k, r in enumerate(runs)],
            ignore_index=True,
        ),
        "kv_transfers": pd.concat([r["kv_transfers"] for r in runs], ignore_index=True),
    }


def _apart(frame: pd.DataFrame, run: int, columns: list[str]) -> pd.DataFrame:
    return frame.assign(**{c: frame[c] + run * RUN_STRIDE for c in columns})


def profile_from_results(
    config: dict,
    device: str,
    fit_on: pd.DataFrame,
    steps: pd.DataFrame,
    transfers: pd.DataFrame,
    requests: pd.DataFrame,
    name: str,
) -> dict:
    if len(fit_on) < MIN_STEPS:
        raise ConfigError(f"{name}: the run has {len(fit_on)} steps; at least {MIN_STEPS} are needed to fit a profile")
    model = ModelConfig(**config["model"]).args()
    cost, fit, causal, scales = best_step_fit(fit_on)
    backend = config.get("kv_transfer", {}).get("backend", "process_group")
    backend = RENAMED_BACKENDS.get(backend, backend)  # a run stored before a rename too
    transfer = transfer_fit(transfers, backend)
    latency, rate = TRANSFER_TERMS[backend]
    scales["transfer_scale"] = transfer_scales(transfers, transfer[latency], transfer[rate])
    scales["step_gap_phase"] = fit_gap_phase(fit_on, scales.get("step_scale_rho", 0.0))
    return {
        "version": 1,
        "model_name": config["model"]["name"],
        "source": name,
        "model": {k: getattr(model, k) for k in SHAPE_KEYS},
        "device": device,
        "dtype_bytes": dtype_bytes(config["model"].get("dtype", "auto"), device),
        "kv_free_bytes": None,
        "causal_attention": causal,
        "cost_model": {**cost, **transfer, "causal_attention": causal},
        "fit": fit,
        "host": {**host_delays(steps, requests), **scales},
    }


def best_step_fit(steps: pd.DataFrame) -> tuple[dict, dict, bool, dict]:
    """Coefficients for the kernel's way of counting prefill keys that fits the steps better
    (a causal kernel, or torch SDPA's dense masked one), and the quantiles of real / fitted step
    time: the contention the shape alone does not explain.

    A step that prefills has a fixed cost of its own (on this machine a 30-token chunk takes
    1.6 ms where a decode step takes 0.4): `prefill_overhead_s`, fitted beside the shared
    overhead. Without it the thousands of decode steps set the overhead, the prefill tokens'
    slope took the rest, small chunks came out 2x fast and large ones slow, and the ratio
    distribution that carries contention took that misfit as noise (a prefill step's p90 at
    2-3x its median where the real one is at 1.2-1.3x)."""
    fits = []
    for causal in (False, True):
        samples = [
            {
                "prefill_tokens": row.prefill_tokens,
                "decode_seqs": row.decode_seqs,
                "decode_context": row.decode_context,
                "seconds": row.end_s - row.start_s,
                "prefill_context": attended_context([tuple(c) for c in row.prefill_chunks], causal),
            }
            for row in steps.itertuples()
            if row.end_s > row.start_s
        ]
        features = np.array(
            [
                step_features(*(float(sample[k]) for k in STEP_INPUTS)) + [float(sample["prefill_tokens"] > 0)]
                for sample in samples
            ]
        )
        coef, error = relative_fit(features, np.array([sample["seconds"] for sample in samples]))
        coefficients = {**dict(zip(STEP_TERMS, map(float, coef))), "prefill_overhead_s": float(coef[-1])}
        fits.append((error["mean"], causal, coefficients, error, features, coef))
    _, causal, coefficients, error, features, coef = min(fits, key=lambda f: f[0])
    ratios = np.array([sample["seconds"] for sample in samples]) / np.maximum(features @ coef, 1e-9)
    ran = steps[steps["end_s"] > steps["start_s"]]  # the samples' rows, in order
    prefill = (ran["prefill_tokens"] > 0).to_numpy()  # the fit errs apart on decode steps and those with prefill
    everything = list(ratios)
    scales = {
        "step_scale": quantiles(ratios[~prefill] if (~prefill).sum() >= MIN_STEPS else everything),
        "step_scale_prefill": quantiles(ratios[prefill] if prefill.sum() >= MIN_STEPS else everything),
        **phase_memory(ran["worker"].to_numpy(), ran["start_s"].to_numpy(), prefill, ratios),
    }
    after = after_prefill(ran["worker"].to_numpy(), ran["start_s"].to_numpy(), prefill)
    if after.sum() >= MIN_STEPS:
        scales["step_scale_after_prefill"] = quantiles(ratios[after])
    return coefficients, {"step_relative_error": error}, causal, scales


def phase_correlation(workers: np.ndarray, starts: np.ndarray, prefill: np.ndarray, ratios: np.ndarray) -> float:
    """The lag-1 correlation of log(real / fitted step time) between a worker's consecutive
    steps (each kind, decode or with prefill, centred on its own mean): how long contention
    lasts. 0 when too few steps follow one another."""
    workers, log_ratio = centred_log_ratio(workers, starts, prefill, ratios)
    rho = lag_correlation(workers, log_ratio, 1)
    return float(np.clip(rho, 0.0, 0.99)) if np.isfinite(rho) else 0.0


def centred_log_ratio(
    workers: np.ndarray, starts: np.ndarray, prefill: np.ndarray, ratios: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(workers, log(real / fitted step time)) in each worker's step order, each kind of step
    (decode, with prefill) centred on its own mean."""
    order = np.lexsort((starts, workers))
    workers, prefill = workers[order], prefill[order]
    log_ratio = np.log(np.maximum(ratios[order], 1e-12))
    for kind in (False, True):
        if (prefill == kind).any():
            log_ratio[prefill == kind] -= log_ratio[prefill == kind].mean()
    return workers, log_ratio


def lag_correlation(workers: np.ndarray, log_ratio: np.ndarray, lag: int) -> float:
    """The correlation between a worker's steps `lag` apart; NaN when too few follow one another."""
    same = workers[lag:] == workers[:-lag]
    if same.sum() < MIN_STEPS or np.std(log_ratio) == 0:
        return float("nan")
    return float(np.corrcoef(log_ratio[:-lag][same], log_ratio[lag:][same])[0, 1])


def after_prefill(workers: np.ndarray, starts: np.ndarray, prefill: np.ndarray) -> np.ndarray:
    """Decode-only steps whose worker's previous step prefilled (a step's caches are cold after
    a prefill: 1.5x a decode step's median time on this machine)."""
    order = np.lexsort((starts, workers))
    previous = np.zeros(len(order), dtype=bool)
    same = workers[order][1:] == workers[order][:-1]
    previous[order[1:]] = prefill[order][:-1] & same
    return previous & ~prefill


PHASE_LAGS = (1, 2, 4, 8, 16, 32)  # steps apart: a request decodes through 16-64 of them


def phase_memory(workers: np.ndarray, starts: np.ndarray, prefill: np.ndarray, ratios: np.ndarray) -> dict:
    """How long contention lasts, as testbed/sim/host.py's Draws draws it: the correlation of
    log(real / fitted step time) between a worker's steps k apart, fitted at PHASE_LAGS by
    w x rho^k (a phase of step-to-step correlation rho carrying a share w of the variance, the
    rest each step's own). {"step_scale_rho": rho, "step_scale_weight": w}; (0, 1) when too few
    steps follow one another."""
    workers, log_ratio = centred_log_ratio(workers, starts, prefill, ratios)
    lags, acf = [], []
    for lag in PHASE_LAGS:
        a = lag_correlation(workers, log_ratio, lag)
        if not np.isfinite(a):
            break
        lags.append(lag)
        acf.append(a)
    if not lags or acf[0] <= 0:
        return {"step_scale_rho": 0.0, "step_scale_weight": 1.0}
    lags, acf = np.array(lags, dtype=float), np.array(acf)
    best = (np.inf, 0.0, 1.0)
    for rho in np.linspace(0.0, 0.99, 199)[1:]:
        powers = rho**lags
        weight = phase_share(acf, powers)
        error = float(np.sum((acf - weight * powers) ** 2))
        if error < best[0]:
            best = (error, float(rho), weight)
    return {"step_scale_rho": best[1], "step_scale_weight": best[2]}


def fit_gap_phase(steps: pd.DataFrame, rho: float) -> float:
    """How much of a busy worker's gap between steps moves with its contention phase: the share c2
    of the gap's normal score that the phase carries, fitted on the gaps' own correlation k gaps
    apart as c2 x rho^k (rho: the steps' phase). On this machine gaps are 0.7 correlated a step
    apart and still 0.4 at 16, as the steps are: drawn independently, a request's gaps averaged
    out over its decode and its TPOT tail came out 15-40% low. 0 without a phase."""
    if not rho:
        return 0.0
    workers, scores = [np.zeros(0)], [np.zeros(0)]
    for worker, gaps, prefilled in busy_gaps(steps):
        score = np.zeros(len(gaps))
        for kind in (False, True):  # after a prefill the gap has its own distribution (step_gap_prefill)
            score[prefilled == kind] = normal_scores(gaps[prefilled == kind])
        workers.append(np.full(len(gaps), worker))
        scores.append(score)
    workers, scores = np.concatenate(workers), np.concatenate(scores)
    acf = np.array([lag_correlation(workers, scores, lag) for lag in PHASE_LAGS])
    powers = rho ** np.array(PHASE_LAGS, dtype=float)
    known = np.isfinite(acf)
    return phase_share(acf[known], powers[known]) if known.any() else 0.0


def phase_share(acf: np.ndarray, powers: np.ndarray) -> float:
    """The least-squares share w of correlations k apart that a phase of rho^k explains (w x rho^k)."""
    return float(np.clip(np.dot(acf, powers) / np.dot(powers, powers), 0.0, 1.0))


def normal_scores(values: np.ndarray) -> np.ndarray:
    """Each value's rank as a standard normal quantile (the Gaussian copula's scale)."""
    if not len(values):
        return values
    ranks = np.argsort(np.argsort(values, kind="stable"), kind="stable")
    return np.array([_NORMAL.inv_cdf((r + 0.5) / len(values)) for r in ranks])


_NORMAL = NormalDist()


def transfer_fit(transfers: pd.DataFrame, backend: str) -> dict:
    """The run's transfers as the coefficients of the transport it used (kv_transfer.backend)."""
    latency, rate = TRANSFER_TERMS[backend]
    moved = moved_transfers(transfers)
    if len(moved) < 2:
        return {latency: 0.0, rate: float("inf")}
    samples = [{"bytes": row.kv_bytes, "seconds": row.end_s - row.start_s} for row in moved.itertuples()]
    fitted, _ = fit_transfer(samples)
    return {latency: fitted["latency_s"], rate: fitted["bytes_per_s"]}


def moved_transfers(transfers: pd.DataFrame) -> pd.DataFrame:
    """The transfers that moved their KV (ended after they started, without a failure)."""
    if not len(transfers):
        return transfers
    return transfers[(transfers.get("outcome", "ok") == "ok") & (transfers["end_s"] > transfers["start_s"])]


def transfer_scales(transfers: pd.DataFrame, latency_s: float, bytes_per_s: float) -> list:
    """Each moved transfer's time over the fitted link's for its bytes, as quantiles ([]: too
    few transfers, or a link fitted as free)."""
    moved = moved_transfers(transfers)
    if len(moved) < MIN_STEPS:
        return []
    fitted = link_time(latency_s, bytes_per_s, moved["kv_bytes"].to_numpy(dtype=float))
    if not np.all(fitted > 0):
        return []
    return quantiles((moved["end_s"] - moved["start_s"]).to_numpy(dtype=float) / fitted)


def dtype_bytes(dtype: str, device: str) -> int:
    """The KV cache's element size as the engine resolved model.dtype for that device."""
    import torch  # here: only an in-situ profile needs it, and it costs a simulation seconds to import

    from testbed.model.loader import resolve_dtype

    return resolve_dtype(dtype, torch.device("cuda" if device == "cuda" else "cpu")).itemsize  # a host: as CPU


# -- host-side delays: each as quantiles (testbed/sim/host.py samples them) -------------------------
def host_delays(steps: pd.DataFrame, requests: pd.DataFrame) -> dict:
    after_decode, after_prefill = step_gaps(steps, prefilled=False), step_gaps(steps, prefilled=True)
    return {
        "dispatch": quantiles(dispatch_delays(steps, requests)),
        "step_gap": quantiles(after_decode if len(after_decode) >= MIN_STEPS else step_gaps(steps)),
        "step_gap_prefill": quantiles(after_prefill) if len(after_prefill) >= MIN_STEPS else [],
        "report": quantiles(report_delays(requests, first=False)),
        "report_first": quantiles(report_delays(requests, first=True)),
        "release": quantiles(requests["dispatched_s"] - requests["arrival_s"]),
        "handoff": quantiles(handoff_delays(requests)),
    }


READ_BURST_S = 20e-6  # receipts closer than this were one read of the router's (its catch-up: ~5 us apart)


def report_delays(requests: pd.DataFrame, first: bool = False) -> np.ndarray:
    """Per read of the router's: the longest a report it read waited since its stamp on the
    worker; over the reports carrying a request's first token (`first`), or the others. The
    simulator draws one delay a step report, independently, so a router stall must count once:
    after one 118 ms stall the router read the 87 reports a worker had sent meanwhile within
    1.3 ms, and counted per token (or per report) they stood for 87 stalls spread over the run
    (a chunked cell's TPOT p99 +145%)."""
    pairs = []
    for c, w in zip(requests["token_times"], requests["token_worker_times"]):
        if len(c) and len(c) == len(w):
            stamped = np.stack([np.asarray(w, dtype=float), np.asarray(c, dtype=float)], axis=1)
            pairs.append(stamped[:1] if first else stamped[1:])
    if not pairs:
        return np.zeros(0)
    reports = np.unique(np.concatenate(pairs), axis=0)  # a step's tokens share its stamp and their receipt
    if first:  # a stall holds each request's first token once: per request, as TTFT counts it
        return reports[:, 1] - reports[:, 0]
    reports = reports[np.argsort(reports[:, 1], kind="stable")]
    delays = reports[:, 1] - reports[:, 0]
    starts = np.flatnonzero(np.diff(reports[:, 1], prepend=-np.inf) > READ_BURST_S)
    return np.maximum.reduceat(delays, starts)


def handoff_delays(requests: pd.DataFrame) -> np.ndarray:
    """P's first token stamped -> the start of its KV transfer (disagg runs; empty otherwise)."""
    if "kv_transfer_start_s" not in requests or "prefill_end_s" not in requests:
        return np.zeros(0)
    return (requests["kv_transfer_start_s"] - requests["prefill_end_s"]).dropna().to_numpy(dtype=float)


def step_gaps(steps: pd.DataFrame, prefilled: Optional[bool] = None) -> np.ndarray:
    """A worker's next step start less this step's end, where the step left work behind; after
    steps that prefilled only, or after decode-only steps only (`prefilled`), or after any."""
    found = [np.zeros(0)]
    for _, gaps, after_prefill in busy_gaps(steps):
        found.append(gaps if prefilled is None else gaps[after_prefill == prefilled])
    return np.concatenate(found)


def busy_gaps(steps: pd.DataFrame):
    """Per worker, in step order: (worker, each gap after a step that left work behind, whether
    that step prefilled)."""
    for worker, own in steps.sort_values("start_s").groupby("worker"):
        busy = (own["num_waiting"] + own["num_running"]).to_numpy()[:-1] > 0
        gaps = own["start_s"].to_numpy()[1:] - own["end_s"].to_numpy()[:-1]
        yield worker, gaps[busy], (own["prefill_tokens"].to_numpy()[:-1] > 0)[busy]


def dispatch_delays(steps: pd.DataFrame, requests: pd.DataFrame) -> np.ndarray:
    """Dispatched -> first step, for requests that reached a worker with nothing to do: between
    steps, and its last step left nothing waiting or running."""
    waits = [np.zeros(0)]
    ran = requests.dropna(subset=["dispatched_s", "prefill_start_s", "prefill_worker"])
    for worker, own in steps.sort_values("start_s").groupby("worker"):
        starts, ends = own["start_s"].to_numpy(), own["end_s"].to_numpy()
        left = (own["num_waiting"] + own["num_running"]).to_numpy()
        mine = ran[ran["prefill_worker"] == worker]
        t = mine["dispatched_s"].to_numpy()
        last = np.searchsorted(starts, t, side="right") - 1  # the last step started before dispatch
        before = np.maximum(last, 0)
        idle = (last < 0) | ((ends[before] <= t) & (left[before] == 0))
        waits.append((mine["prefill_start_s"].to_numpy() - t)[idle])
    return np.concatenate(waits)


def quantiles(values) -> list[float]:
    """The distribution as quantiles at host.LEVELS; [] when nothing was measured."""
    values = np.asarray(values, dtype=float)
    values = np.clip(values[np.isfinite(values)], 0.0, None)
    return list(Delay.of(values).quantiles) if len(values) else []
