"""The catalog of studies: for each, the points it runs and what it computes across them.

Every study runs on the same N devices (hardware.num_devices, or every visible GPU) so that its
configurations compare at equal hardware: colocated and chunked use N mixed workers, and a
disaggregated split pP:dD has p + d = N.
"""

from __future__ import annotations

from testbed.cluster.layout import cuda_count
from testbed.config import Config
from testbed.errors import ConfigError
from testbed.studies.repeats import OTHER_REPEATS
from testbed.studies.sweep import Point


def num_devices(cfg: Config) -> int:
    if cfg.hardware.num_devices is not None:
        return cfg.hardware.num_devices
    count = cuda_count(cfg.hardware)
    if count:
        return count
    return 2


# What executor=http can run: studies whose points differ in traffic and SLOs. The others vary the
# testbed's own engine (splits, chunk sizes, hand-offs) or measure this machine.
OVER_HTTP = ("serve", "ratio_sweep", "rate_sweep", "mode_compare", "slo_scale", "input_buckets", "burstiness")


def check_executor(cfg: Config) -> None:
    """What runs the study can run it here: over HTTP only the traffic studies; simulated on a GPU
    box only on a GPU's profile (check_profiles)."""
    if cfg.executor == "http" and cfg.experiment.name not in OVER_HTTP:
        raise ConfigError(f"executor=http runs {', '.join(OVER_HTTP)}; experiment={cfg.experiment.name} varies or "
                          f"measures the testbed's own engine")
    check_profiles(cfg)


# -- the simulator's device on a GPU box ----------------------------------------------------------
ROLES = ("mixed", "prefill", "decode")


def check_profiles(cfg: Config) -> None:
    """On a GPU box a simulated study stands for this GPU, so each role runs on a GPU's profile:
    one measured here (sim.profile=<profile.json>, as a CPU box runs on its shipped CPU profile)
    or a GPU of the analytical table. Unset, the simulator would load the shipped CPU profile;
    rather than swap in the roofline unasked, the study stops and says how to measure this GPU.
    sim_validate's simulated points fit theirs in situ on this GPU's real points when unset."""
    if not simulates(cfg) or not cuda_count(cfg.hardware):
        return
    from testbed.perf.resolve import profile_device

    for role in ROLES:
        spec = cfg.sim.spec(role)
        if spec is None and cfg.experiment.name == "sim_validate":
            continue
        if spec is None or profile_device(spec) == "cpu":
            raise ConfigError(missing_profile(cfg, cfg.sim.key(role), spec))


def simulates(cfg: Config) -> bool:
    """The study's points run in the simulator: executor=sim, plan, or sim_validate's half."""
    return cfg.executor == "sim" or cfg.experiment.name in ("plan", "sim_validate")


def missing_profile(cfg: Config, key: str, spec: str | None) -> str:
    """One line: which profile is missing and the commands that make or replace it."""
    from testbed.perf import GPUS

    what = f"{key}={spec} was measured on a CPU" if spec else f"{key} is unset (a shipped CPU profile by default)"
    analytical = gpu_here() or " | ".join(sorted(GPUS))
    return (f"{what}, but experiment={cfg.experiment.name} on this GPU box simulates this GPU: measure it with "
            f"`{profile_command(cfg)}` and pass {key}=<its profile.json>, or take the roofline: {key}={analytical}")


def profile_command(cfg: Config) -> str:
    """The profile study for the configured model: its shape (and context) is what the profile must match."""
    return f"python -m testbed +experiment=profile {model_overrides(cfg)}"


def model_overrides(cfg: Config) -> str:
    """The command-line settings that give another run this run's model (`model=NAME model.KEY=...`)."""
    from dataclasses import fields

    from testbed.model.config import ModelArgs

    model = cfg.model
    out = ["model=hf", f"model.path={model.path}"] if model.path else [f"model={model.name}"]
    keys = [f.name for f in fields(ModelArgs) if f.name != "rope_scaling"]
    return " ".join(out + [f"model.{k}={getattr(model, k)}" for k in keys if getattr(model, k) is not None])


def gpu_here() -> str | None:
    """The analytical table's name for CUDA device 0 (None without CUDA or for a GPU it lacks)."""
    import torch

    from testbed.perf.resolve import table_gpu

    return table_gpu(torch.cuda.get_device_name(0)) if torch.cuda.is_available() else None


def layouts(cfg: Config, modes: list[str], all_splits: bool = False) -> list[tuple[str, dict]]:
    """(label, overrides) per serving configuration on N devices; over HTTP, the one server."""
    if cfg.executor == "http":
        return [(cfg.http.label, {"mode": cfg.mode})]
    n = num_devices(cfg)
    out = []
    for mode in modes:
        if mode != "disagg":
            out.append((mode, {"mode": mode, "cluster.num_workers": n}))
            continue
        if n < 2:
            raise ConfigError(f"mode=disagg needs at least 2 devices; hardware.num_devices={n}")
        splits = range(1, n) if all_splits else [n // 2]
        out += [(f"{p}P{n - p}D", {"mode": "disagg", "cluster.num_prefill": p, "cluster.num_decode": n - p})
                for p in splits]
    return out


def _rates(cfg: Config) -> list[float]:
    return list(cfg.experiment.rates) or [cfg.workload.rate]


def _grid(cfg: Config, configs: list[tuple[str, dict]], axis: str, values: list, key: str) -> list[Point]:
    points = []
    for label, overrides in configs:
        for value in values:
            name = f"{label}_{axis}{value:g}" if isinstance(value, float) else f"{label}_{axis}{value}"
            knobs = {"label": label, "mode": overrides["mode"], axis: value}
            points.append(Point(name, {**overrides, key: value}, knobs))
    return points


# -- point builders -----------------------------------------------------------------------------
def ratio_sweep(cfg: Config) -> list[Point]:
    if cfg.executor == "http":
        return rate_sweep(cfg)
    configs = layouts(cfg, ["colocated", "chunked"]) + layouts(cfg, ["disagg"], all_splits=True)
    return _grid(cfg, configs, "rate", _rates(cfg), "workload.rate")


def rate_sweep(cfg: Config) -> list[Point]:
    return _grid(cfg, layouts(cfg, list(cfg.experiment.modes)), "rate", _rates(cfg), "workload.rate")


def one_rate(cfg: Config) -> list[Point]:
    """mode_compare, slo_scale, input_buckets: every mode once, at workload.rate."""
    return [Point(label, overrides, {"label": label, "mode": overrides["mode"], "rate": cfg.workload.rate})
            for label, overrides in layouts(cfg, list(cfg.experiment.modes))]


def chunk_sweep(cfg: Config) -> list[Point]:
    points = _grid(cfg, layouts(cfg, ["chunked"]), "chunk", list(cfg.experiment.chunk_sizes), "scheduler.chunk_size")
    for point in points:  # every running decode must fit in the chunk
        point.overrides["scheduler.max_running"] = min(cfg.scheduler.max_running, point.knobs["chunk"])
    return points


def burstiness(cfg: Config) -> list[Point]:
    points = _grid(cfg, layouts(cfg, list(cfg.experiment.modes)), "burstiness", list(cfg.experiment.burstiness),
                   "workload.burstiness")
    for point in points:
        point.overrides["workload.arrival"] = "gamma"
    return points


def interference(cfg: Config) -> list[Point]:
    """Per mode: the decode background alone (the baseline), then with prefills of each length,
    one at a time at evenly spaced arrivals, the background sized to keep decoding through them."""
    background = {"workload.background_output_len": background_len(cfg)}
    points = []
    for label, overrides in layouts(cfg, list(cfg.experiment.modes)):
        base = {**overrides, **background, "workload.num_requests": 0}
        points.append(Point(f"{label}_baseline", base, {"label": label, "mode": overrides["mode"], "prefill_len": 0}))
        for length in cfg.experiment.prefill_lengths:
            fixed = {"workload.input_len.dist": "fixed", "workload.input_len.mean": float(length),
                     "workload.input_len.min": 1, "workload.input_len.max": int(length),
                     "workload.arrival": "constant"}
            points.append(Point(f"{label}_prefill{length}", {**overrides, **background, **fixed},
                                {"label": label, "mode": overrides["mode"], "prefill_len": length}))
    return points


def background_len(cfg: Config) -> int:
    """Background output tokens that outlast the injection window (num_requests / rate, arrivals
    evenly spaced): the window over the modelled decode step of the whole background on one
    worker (the device's cost model: emulated, simulated, or this CPU's shipped profile), times
    experiment.background_margin (0: keep the configured length); never below
    workload.background_output_len, never past the model's length."""
    w, margin = cfg.workload, cfg.experiment.background_margin
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


def multiturn(cfg: Config) -> list[Point]:
    """Every layout x dispatch policy; a disaggregated layout once per hand-off of later turns
    (experiment.handoffs: resend, incremental, ppd), its decode workers chosen by the same policy
    where that policy is kv_aware (so a session's KV is found again)."""
    points = []
    for label, overrides in layouts(cfg, list(cfg.experiment.modes)):
        disagg = overrides["mode"] == "disagg"
        for policy in cfg.experiment.dispatch:
            for handoff in cfg.experiment.handoffs if disagg else [None]:
                knobs = {"label": f"{label} {handoff}" if disagg else label, "mode": overrides["mode"],
                         "dispatch": policy}
                point = {**overrides, "cluster.dispatch": policy}
                if disagg:
                    knobs["handoff"] = handoff
                    point["kv_transfer.multiturn"] = handoff
                    point["cluster.decode_dispatch"] = "kv_aware" if policy == "kv_aware" else "least_loaded"
                name = f"{label}_{handoff}_{policy}" if disagg else f"{label}_{policy}"
                points.append(Point(name, point, knobs))
    return points


CALIBRATION_SEED = 1000  # a calibration run's seed offset: other requests than any validated repeat
CALIBRATION_REQUESTS = 3  # x workload.num_requests: enough steps for the fit's tails


def sim_validate(cfg: Config) -> list[Point]:
    """The same workload run for real and simulated, per mode and rate. The simulator runs on a
    profile fitted in situ (testbed/sim/in_situ.py), never on the run it is compared with: with
    repeats, on the real runs of the other repeats of the same cell, pooled (a cell's repeats run
    one after the other, so the fit was measured while the machine was in the state the compared
    run saw: a shared two-core machine's step times drift by a third over tens of seconds, the
    gap between two rates' cells, and fitting across rates carried that drift into every cell;
    all real points run first); with one repeat, on a calibration run of its own seed at the
    middle rate. With hardware.emulate it runs on the very cost model that paces the real
    workers instead, so what differs is the control plane alone; an explicit sim.profile is kept."""
    calibrate = not emulated_sim(cfg) and cfg.sim.profile is None
    cells = rate_sweep(cfg)
    real = [Point(f"{p.name}_real", {**p.overrides, "executor": "real"}, {**p.knobs, "executor": "real"}) for p in cells]
    calibration = []
    if calibrate and not 1 < cfg.experiment.repeats <= 10:  # a repeat suffix of one digit: the glob holds
        rate = _rates(cfg)[len(_rates(cfg)) // 2]
        for label, overrides in layouts(cfg, list(cfg.experiment.modes)):
            calibration.append(Point(f"calibrate_{label}", {**overrides, "workload.rate": rate, "executor": "real",
                                     "seed": cfg.seed + CALIBRATION_SEED,
                                     "workload.num_requests": CALIBRATION_REQUESTS * cfg.workload.num_requests},
                                     {"label": label, "mode": overrides["mode"], "rate": rate,
                                      "executor": "calibration"}, repeat=False))
    sims = []
    for point in cells:
        label = point.knobs["label"]
        profile = {"sim.profile": f"run:{{points}}/calibrate_{label}" if calibration else
                   f"run:{{points}}/{point.name}_real_r{OTHER_REPEATS}"} if calibrate else emulated_sim(cfg)
        sims.append(Point(f"{point.name}_sim", {**point.overrides, **profile, "executor": "sim"},
                          {**point.knobs, "executor": "sim"}))
    return calibration + real + sims


def emulated_sim(cfg: Config) -> dict:
    """The simulator's settings that stand for the emulated devices ({} when not emulated)."""
    hw = cfg.hardware
    if not (hw.emulate or hw.emulate_prefill or hw.emulate_decode):
        return {}
    out = {"sim.profile": hw.emulate, "sim.prefill_profile": hw.emulate_prefill,
           "sim.decode_profile": hw.emulate_decode}
    if hw.emulate_model:
        out["model.name"] = hw.emulate_model
    return {k: v for k, v in out.items() if v is not None}


def plan(cfg: Config) -> list[Point]:
    """Simulated search: every split, colocated, and chunked at each chunk size (the default one
    labelled plain `chunked`, as in ratio_sweep), over the rates."""
    configs = layouts(cfg, ["colocated"]) + layouts(cfg, ["disagg"], all_splits=True)
    default = cfg.scheduler.chunk_size  # the chunked baseline every other study (ratio_sweep) runs
    for label, overrides in layouts(cfg, ["chunked"]):
        for chunk in sorted({default, *cfg.experiment.chunk_sizes}):
            name = label if chunk == default else f"{label}{chunk}"  # "chunked" matches a measured sweep
            configs.append((name, {**overrides, "scheduler.chunk_size": chunk,
                                   "scheduler.max_running": min(cfg.scheduler.max_running, chunk)}))
    points = _grid(cfg, configs, "rate", _rates(cfg), "workload.rate")
    for point in points:
        point.overrides["executor"] = "sim"
    return points
