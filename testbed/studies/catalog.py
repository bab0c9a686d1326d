"""The catalog of studies: one `Study` record per study (STUDIES, at the end: its points, its
aggregate, its figures, what can run it, its tiny size), and the point builders it names.

Every study runs on the same N devices (hardware.num_devices, or every visible GPU) so that its
configurations compare at equal hardware: colocated and chunked use N mixed workers, and a
disaggregated split pP:dD has p + d = N.

A new study is three files: testbed/studies/NAME.py (its settings, points, aggregate and declared
figures, and its record STUDY: testbed/studies/study.py), conf/experiment/NAME.yaml, and
experiments/NAME/README.md; module_studies finds it by its YAML (testbed/studies/batch_cap.py is one).
"""

from __future__ import annotations

import logging
from importlib import import_module

from testbed.cluster.layout import cuda_count
from testbed.config import Config, study_names, with_overrides
from testbed.deploy.checkpoint import NAME as CHECKPOINT
from testbed.errors import ConfigError
from testbed.experiment import ONE_POINT
from testbed.studies import aggregates, placements
from testbed.studies.aggregates import TABLE
from testbed.studies.layouts import axis_grid, layouts, rates
from testbed.studies.machine import missing_profile, num_devices
from testbed.studies.repeats import OTHER_REPEATS
from testbed.studies.study import Study
from testbed.studies.sweep import Point
from testbed.tracking.run_meta import CHECKOUT

log = logging.getLogger("testbed")


def check_executor(cfg: Config) -> None:
    """What runs the study can run it here: over HTTP only the traffic studies (Study.over_http);
    simulated on a GPU box only on a GPU's profile (check_profiles)."""
    if cfg.executor == "http" and not study(cfg.experiment.name).over_http:
        over_http = ", ".join(s.name for s in STUDIES if s.over_http)
        raise ConfigError(
            f"executor=http runs {over_http}; experiment={cfg.experiment.name} varies or "
            f"measures the testbed's own engine"
        )
    if cfg.executor == "vllm" and not study(cfg.experiment.name).on_vllm:
        on_vllm = ", ".join(s.name for s in STUDIES if s.on_vllm)
        raise ConfigError(
            f"executor=vllm runs {on_vllm}; experiment={cfg.experiment.name} varies or measures the testbed's "
            f"own engine"
        )
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
        if spec is None and study(cfg.experiment.name).fits_in_situ:
            continue
        if spec is None or profile_device(spec) == "cpu":
            raise ConfigError(missing_profile(cfg, cfg.sim.key(role), spec))


def simulates(cfg: Config) -> bool:
    """The study's points run in the simulator: executor=sim, plan, or sim_validate's half."""
    chosen = study(cfg.experiment.name)
    return cfg.executor == "sim" or chosen.simulated or chosen.fits_in_situ


# -- point builders -----------------------------------------------------------------------------
def ratio_sweep(cfg: Config) -> list[Point]:
    """Colocated, chunked and every split at the cluster's degrees, over the rates. With
    experiment.tp_degrees beyond [1], or a simulated model one device cannot hold (then the smallest
    degrees that hold it: placements.fitting_degrees, said in one log line), every placement over
    those degrees that fits memory instead (placements.search), each point with its degrees as knobs."""
    if cfg.executor == "http":
        return rate_sweep(cfg)
    degrees = list(cfg.experiment.tp_degrees)
    c = cfg.cluster
    if degrees == [1] and c.tp == c.prefill_tp == c.decode_tp == 1:
        degrees, why = placements.fitting_degrees(cfg, num_devices(cfg))
        if why:
            log.info("ratio_sweep: %s", why)
    if degrees == [1]:
        configs = layouts(cfg, ["colocated", "chunked"]) + layouts(cfg, ["disagg"], all_splits=True)
        return axis_grid(cfg, configs, "rate", rates(cfg), "workload.rate")
    kept, pruned = placements.search(cfg, num_devices(cfg), degrees)
    if pruned:
        log.info(
            "ratio_sweep: %d placements over TP %s run, %d pruned (memory or heads)", len(kept), degrees, len(pruned)
        )
    points = axis_grid(cfg, [(p.label, p.overrides_over(c)) for p in kept], "rate", rates(cfg), "workload.rate")
    knobs = {p.label: p.knobs for p in kept}
    for point in points:
        point.knobs.update(knobs[point.knobs["label"]])
    return points


def rate_sweep(cfg: Config) -> list[Point]:
    return axis_grid(cfg, layouts(cfg, list(cfg.experiment.modes)), "rate", rates(cfg), "workload.rate")


def one_rate(cfg: Config) -> list[Point]:
    """mode_compare, slo_scale, input_buckets: every mode once, at workload.rate."""
    return [
        Point(label, overrides, {"label": label, "mode": overrides["mode"], "rate": cfg.workload.rate})
        for label, overrides in layouts(cfg, list(cfg.experiment.modes))
    ]


def chunk_sweep(cfg: Config) -> list[Point]:
    points = axis_grid(
        cfg, layouts(cfg, ["chunked"]), "chunk", list(cfg.experiment.chunk_sizes), "scheduler.chunk_size"
    )
    for point in points:  # every running decode must fit in the chunk
        point.overrides["scheduler.max_running"] = min(cfg.scheduler.max_running, point.knobs["chunk"])
    return points


def burstiness(cfg: Config) -> list[Point]:
    points = axis_grid(
        cfg,
        layouts(cfg, list(cfg.experiment.modes)),
        "burstiness",
        list(cfg.experiment.burstiness),
        "workload.burstiness",
    )
    for point in points:
        point.overrides["workload.arrival"] = "gamma"
    return points


def concurrency_sweep(cfg: Config) -> list[Point]:
    """Every mode under a closed loop of each number of users (no offered rate: the users' pace)."""
    configs = layouts(cfg, list(cfg.experiment.modes))
    return axis_grid(cfg, configs, "concurrency", list(cfg.experiment.concurrencies), "workload.concurrency")


def interference(cfg: Config) -> list[Point]:
    """Per mode: the decode background alone (the baseline), then with prefills of each length,
    one at a time at evenly spaced arrivals, the background sized to keep decoding through them."""
    background = {"workload.background_output_len": background_len(cfg)}
    points = []
    for label, overrides in layouts(cfg, list(cfg.experiment.modes)):
        base = {**overrides, **background, "workload.num_requests": 0}
        points.append(Point(f"{label}_baseline", base, {"label": label, "mode": overrides["mode"], "prefill_len": 0}))
        for length in cfg.experiment.prefill_lengths:
            fixed = {
                "workload.input_len.dist": "fixed",
                "workload.input_len.mean": float(length),
                "workload.input_len.min": 1,
                "workload.input_len.max": int(length),
                "workload.arrival": "constant",
            }
            points.append(
                Point(
                    f"{label}_prefill{length}",
                    {**overrides, **background, **fixed},
                    {"label": label, "mode": overrides["mode"], "prefill_len": length},
                )
            )
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
                knobs = {
                    "label": f"{label} {handoff}" if disagg else label,
                    "mode": overrides["mode"],
                    "dispatch": policy,
                }
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
    if cfg.executor == "vllm":
        return sim_validate_vllm(cfg)
    calibrate = not emulated_sim(cfg) and cfg.sim.profile is None
    cells = rate_sweep(cfg)
    real = [
        Point(f"{p.name}_real", {**p.overrides, "executor": "real"}, {**p.knobs, "executor": "real"}) for p in cells
    ]
    calibration = []
    if calibrate and not 1 < cfg.experiment.repeats <= 10:  # a repeat suffix of one digit: the glob holds
        rate = rates(cfg)[len(rates(cfg)) // 2]
        for label, overrides in layouts(cfg, list(cfg.experiment.modes)):
            calibration.append(
                Point(
                    f"calibrate_{label}",
                    {
                        **overrides,
                        "workload.rate": rate,
                        "executor": "real",
                        "seed": cfg.seed + CALIBRATION_SEED,
                        "workload.num_requests": CALIBRATION_REQUESTS * cfg.workload.num_requests,
                    },
                    {"label": label, "mode": overrides["mode"], "rate": rate, "executor": "calibration"},
                    repeat=False,
                )
            )
    sims = []
    for point in cells:
        label = point.knobs["label"]
        profile = (
            {
                "sim.profile": f"run:{{points}}/calibrate_{label}"
                if calibration
                else f"run:{{points}}/{point.name}_real_r{OTHER_REPEATS}"
            }
            if calibrate
            else emulated_sim(cfg)
        )
        sims.append(
            Point(
                f"{point.name}_sim",
                {**point.overrides, **profile, "executor": "sim"},
                {**point.knobs, "executor": "sim"},
            )
        )
    return calibration + real + sims


def sim_validate_vllm(cfg: Config) -> list[Point]:
    """sim_validate against vLLM: the real points on vLLM deployments, the simulated ones on a
    profile of vLLM measured beforehand (`+experiment=profile executor=vllm`: its steps, its KV
    link and its front end), the simulator given the served checkpoint's shape."""
    import json
    from pathlib import Path

    if cfg.sim.profile is None or not cfg.sim.profile.endswith(".json"):
        raise ConfigError(
            "sim_validate with executor=vllm simulates on a profile of vLLM: measure it with `python -m testbed "
            "+experiment=profile executor=vllm` and pass sim.profile=<its profile.json>"
        )
    profile = json.loads(Path(cfg.sim.profile).read_text())
    if profile.get("engine") != "vllm":
        raise ConfigError(f"sim.profile={cfg.sim.profile} was measured on the testbed's engine, not on vLLM")
    model = cfg.vllm.model or str(cfg.vllm.cache() / CHECKPOINT)
    cells = rate_sweep(cfg)
    real = [Point(f"{p.name}_real", {**p.overrides}, {**p.knobs, "executor": "real"}) for p in cells]
    simulated = {
        "executor": "sim",
        "model.name": "hf",
        "model.path": model,
        "model.max_model_len": cfg.vllm.max_model_len,  # what the instances serve, not the checkpoint's 8K
        "engine.kv_cache_mib": int(cfg.vllm.kv_space_gib * 1024),  # each instance's KV space
        "sim.frontend_latency_s": float(profile.get("frontend_latency_s") or 0.0),
        "sim.handoff_latency_s": profile.get("handoff_latency_s"),
    }
    sims = [Point(f"{p.name}_sim", {**p.overrides, **simulated}, {**p.knobs, "executor": "sim"}) for p in cells]
    return real + sims


def emulated_sim(cfg: Config) -> dict:
    """The simulator's settings that stand for the emulated devices ({} when not emulated)."""
    hw = cfg.hardware
    if not (hw.emulate or hw.emulate_prefill or hw.emulate_decode):
        return {}
    out = {
        "sim.profile": hw.emulate,
        "sim.prefill_profile": hw.emulate_prefill,
        "sim.decode_profile": hw.emulate_decode,
    }
    if hw.emulate_model:
        out["model.name"] = hw.emulate_model
    return {k: v for k, v in out.items() if v is not None}


def plan(cfg: Config) -> list[Point]:
    """Simulated search: every split, colocated, and chunked at each chunk size (the default one
    labelled plain `chunked`, as in ratio_sweep), over the rates. With experiment.tp_degrees beyond
    [1]: every placement of the devices over those degrees that can run (studies/placements.py),
    chunked's chunk sizes tried at TP1 only (TP multiplies the placements; the chunk size is its own
    axis), each point with its degrees as knobs. Left at [1] where one device cannot hold the
    model: the smallest degrees that hold it (placements.fitting_degrees, as ratio_sweep), so no
    layout that cannot fit is simulated."""
    degrees, why = list(cfg.experiment.tp_degrees), None
    c = cfg.cluster
    if degrees == [1] and c.tp == c.prefill_tp == c.decode_tp == 1:
        simulated = cfg if cfg.executor == "sim" else with_overrides(cfg, {"executor": "sim"})
        degrees, why = placements.fitting_degrees(simulated, num_devices(cfg))
        if why:
            log.info("plan: %s", why)
    if degrees == [1]:
        configs = [
            (label, o, {}) for label, o in layouts(cfg, ["colocated"]) + layouts(cfg, ["disagg"], all_splits=True)
        ]
        configs += [
            (name, o, {}) for label, o in layouts(cfg, ["chunked"]) for name, o in chunk_variants(cfg, label, o)
        ]
    else:
        configs = tp_configs(with_overrides(cfg, {"experiment.tp_degrees": degrees}) if why else cfg)
    points = axis_grid(cfg, [(label, o) for label, o, _ in configs], "rate", rates(cfg), "workload.rate")
    knobs = {label: k for label, _, k in configs}
    for point in points:
        point.overrides["executor"] = "sim"
        point.knobs.update(knobs[point.knobs["label"]])
    return points


def chunk_variants(cfg: Config, label: str, overrides: dict, sizes=None) -> list[tuple[str, dict]]:
    """A chunked layout at each chunk size (default: scheduler.chunk_size and experiment.chunk_sizes);
    the default one keeps the plain label, which matches a measured sweep's."""
    default = cfg.scheduler.chunk_size  # the chunked baseline every other study (ratio_sweep) runs
    out = []
    for chunk in sorted({default, *(cfg.experiment.chunk_sizes if sizes is None else sizes)}):
        name = label if chunk == default else f"{label}{chunk}"
        chunked = {"scheduler.chunk_size": chunk, "scheduler.max_running": min(cfg.scheduler.max_running, chunk)}
        out.append((name, {**overrides, **chunked}))
    return out


def tp_configs(cfg: Config) -> list[tuple[str, dict, dict]]:
    """(label, overrides, knobs) of each placement the TP search keeps, its points within
    experiment.placement_requests."""
    kept, _ = placements.search(cfg, num_devices(cfg))
    budget = cfg.experiment.placement_requests
    fewer = {"workload.num_requests": budget} if budget is not None and budget < cfg.workload.num_requests else {}
    out = []
    for p in kept:
        overrides = {**p.overrides_over(cfg.cluster), **fewer}
        if p.mode != "chunked":
            out.append((p.label, overrides, p.knobs))
            continue
        variants = chunk_variants(cfg, p.label, overrides, None if p.tp == 1 else [])
        out += [(name, o, p.knobs) for name, o in variants]
    return out


# Studies that are no sweep, imported when they run: kv_bandwidth and profile load torch.
def _kv_bandwidth(cfg: Config, out_dir, run_point, session=None) -> dict:
    from testbed.studies.kv_bandwidth import run_kv_bandwidth

    return run_kv_bandwidth(cfg, out_dir)


def _profile(cfg: Config, out_dir, run_point, session=None) -> dict:
    from testbed.studies.profile import run_profile, run_vllm_profile

    if cfg.executor == "vllm":  # `session`: the run's vLLM deployments
        return run_vllm_profile(cfg, out_dir, session)
    return run_profile(cfg, out_dir)


def _replay(cfg: Config, out_dir, run_point, session=None) -> dict:
    from testbed.studies.replay import run_replay

    return run_replay(cfg, out_dir, run_point)


BUCKETS = [f"ttft_by_bucket_{b}_{s}" for b in ("0-1K", "1K-4K", "4K-16K", "16K+") for s in ("p50", "p99")]
REPLAYED = CHECKOUT / "tests" / "data" / "replay"

BUILT_IN = (
    Study(ONE_POINT, "one point with the config as it is", over_http=True, on_vllm=True),
    Study(
        "ratio_sweep",
        "goodput per GPU of every P:D split beside colocated and chunked, over rates",
        ratio_sweep,
        aggregates.goodput_study,
        figures=("goodput_per_gpu", "attainment_vs_rate", "latency_vs_rate", "placement_goodput"),
        searches_goodput=True,
        over_http=True,
        mergeable=True,
        rate_axis=True,
        needs_requests=True,
        on_vllm=True,
        tiny=("experiment.rates=[20,40]",),
        keys=("tp_degrees", "placement_requests", "modes"),
    ),
    Study(
        "rate_sweep",
        "each mode's SLO attainment and latency over offered rates, and its goodput",
        rate_sweep,
        aggregates.goodput_study,
        figures=("attainment_vs_rate", "latency_vs_rate"),
        searches_goodput=True,
        over_http=True,
        mergeable=True,
        rate_axis=True,
        needs_requests=True,
        on_vllm=True,
        tiny=("experiment.rates=[20,40]", "experiment.modes=[chunked,disagg]"),
        keys=("modes",),
    ),
    Study(
        "mode_compare",
        "every mode once at workload.rate: latency, attainment and throughput side by side",
        one_rate,
        aggregates.by_label(TABLE),
        figures=("latency_summary", "latency_cdfs", "timelines", "telemetry"),
        over_http=True,
        mergeable=True,
        on_vllm=True,
        keys=("modes",),
    ),
    Study(
        "slo_scale",
        "each mode's SLO attainment as the SLOs scale tighter or looser",
        one_rate,
        aggregates.slo_scale,
        figures=("attainment_vs_scale", "latency_cdfs"),
        over_http=True,
        mergeable=True,
        needs_requests=True,
        on_vllm=True,
        tiny=("experiment.modes=[colocated,disagg]",),
        keys=("modes", "slo_scales"),
    ),
    Study(
        "interference",
        "how much prefills of each length slow a decoding background (ITL inflation)",
        interference,
        aggregates.interference,
        figures=("itl_inflation",),
        # probes 0.2 s apart: the background is decoding when the first arrives, on a loaded CPU too
        on_vllm=True,
        tiny=(
            "experiment.modes=[colocated,disagg]",
            "experiment.prefill_lengths=[256]",
            "workload.background_requests=4",
            "workload.background_output_len=48",
            "workload.num_requests=3",
            "workload.rate=5",
            "experiment.background_margin=1",
        ),
        keys=("modes", "prefill_lengths", "background_margin"),
    ),
    Study(
        "chunk_sweep",
        "chunked prefill's chunk size: TTFT against TPOT",
        chunk_sweep,
        aggregates.by_label(["chunk", *TABLE]),
        figures=("chunk_tradeoff",),
        on_vllm=True,
        tiny=("experiment.chunk_sizes=[32,256]", "hardware.num_devices=1"),
        keys=("chunk_sizes",),
    ),
    Study(
        "input_buckets",
        "each mode's TTFT by prompt-length bucket",
        one_rate,
        aggregates.by_label(BUCKETS),
        figures=("ttft_by_bucket",),
        over_http=True,
        mergeable=True,
        needs_requests=True,
        on_vllm=True,
        tiny=("experiment.modes=[chunked,disagg]", "workload.input_len.max=6000"),
        keys=("modes",),
    ),
    Study(
        "burstiness",
        "SLO attainment and TTFT as arrivals get burstier (gamma shape)",
        burstiness,
        aggregates.burstiness,
        figures=("burstiness",),
        over_http=True,
        on_vllm=True,
        tiny=("experiment.burstiness=[0.5,2.0]", "experiment.modes=[chunked]"),
        keys=("modes", "burstiness"),
    ),
    Study(
        "concurrency_sweep",
        "closed-loop users: throughput and latency against the number of requests in flight",
        concurrency_sweep,
        aggregates.concurrency_sweep,
        figures=("latency_vs_concurrency",),
        over_http=True,
        on_vllm=True,
        tiny=("experiment.concurrencies=[1,4]", "experiment.modes=[chunked]"),
        keys=("modes", "concurrencies"),
    ),
    Study(
        "multiturn",
        "multi-turn sessions: dispatch policies and how later turns' KV is handed over",
        multiturn,
        aggregates.multiturn,
        figures=("ttft_by_turn", "kv_bytes_by_turn", "decode_itl_with_appends"),
        on_vllm=True,
        tiny=(
            "workload.num_requests=2",
            "workload.rate=20",  # sessions at once: at the CPU size's 1/s the first came 2.5 s in, idle
            "workload.turns=3",
            "workload.think_time_s=0.05",
            "experiment.modes=[chunked,disagg]",
            "experiment.dispatch=[kv_aware]",
        ),
        keys=("modes", "dispatch", "handoffs"),
    ),
    Study(
        "kv_bandwidth",
        "the KV connector's bandwidth against a raw copy, by message size",
        runs=_kv_bandwidth,
        figures=("kv_bandwidth",),
        one_box=True,
        tiny=("experiment.message_mib=1",),
        keys=("message_mib",),
    ),
    Study(
        "profile",
        "this machine's step times, fitted to the cost model the simulator runs on",
        runs=_profile,
        one_box=True,
        on_vllm=True,  # vLLM's steps from its metrics (testbed/deploy/profile.py)
        tiny=("experiment.quick_profile=true",),
        keys=("quick_profile",),
    ),
    Study(
        "sim_validate",
        "the simulator against real runs of the same workload, per mode and rate",
        sim_validate,
        aggregates.sim_validate,
        figures=("sim_vs_real",),
        fits_in_situ=True,
        # a tiny paced run on a shared CPU exercises the study, it measures no fidelity: kept in its
        # tables however many steps overran (tests/e2e/test_experiments.py judges the pace itself)
        on_vllm=True,  # against vLLM: its real points on vLLM, its simulated ones on a profile of vLLM
        tiny=(
            "experiment.rates=[20]",
            "experiment.modes=[chunked]",
            "hardware.emulate=h100_sxm",
            "hardware.emulate_model=llama3_8b",
            "hardware.max_overrun_share=1",
        ),
        keys=("modes",),
    ),
    Study(
        "plan",
        "a simulated search of splits and chunk sizes for the most goodput per GPU",
        plan,
        aggregates.plan,
        figures=("plan_goodput", "placement_goodput"),
        searches_goodput=True,
        simulated=True,
        tiny=(
            "experiment.rates=[20,80]",
            "experiment.chunk_sizes=[64]",
            "hardware.num_devices=3",
            "workload.num_requests=40",
        ),
        keys=("tp_degrees", "placement_requests", "chunk_sizes", "measured_sweep"),
    ),
    # a published GPU run replayed in the simulator (its workload is the reference's, not TINY_BASE's)
    Study(
        "replay",
        "a published engine's run replayed in the simulator, compared figure by figure",
        runs=_replay,
        tiny=(
            f"experiment.reference={REPLAYED / 'sglang030_a100_llama31_8b_rps4.jsonl'}",
            f"experiment.setup={REPLAYED / 'sglang030_a100.setup.yaml'}",
        ),
        keys=("reference", "setup", "replay_emulate"),
    ),
)


def module_studies(built_in: tuple[Study, ...]) -> tuple[Study, ...]:
    """The studies written as one module each: a conf/experiment/NAME.yaml with no record above is
    testbed/studies/NAME.py, whose STUDY is its record (testbed/studies/study.py)."""
    known = {s.name for s in built_in}
    found = []
    for name in (n for n in study_names() if n not in known):
        module = import_module(f"testbed.studies.{name}")
        record = getattr(module, "STUDY", None)
        if not isinstance(record, Study) or record.name != name:
            raise ConfigError(
                f"conf/experiment/{name}.yaml has no study: testbed/studies/{name}.py must define "
                f"STUDY = Study({name!r}, ...)"
            )
        found.append(record)
    return tuple(found)


STUDIES = BUILT_IN + module_studies(BUILT_IN)
BY_NAME = {s.name: s for s in STUDIES}

# what every tiny run shares: two CPU workers, one repeat, a handful of requests, no figures
TINY_BASE = (
    "hardware=cpu",
    "hardware.num_devices=2",
    "experiment.figures=false",
    "experiment.repeats=1",
    "experiment.search_points=1",
    "experiment.background_margin=0",
    "workload.num_requests=6",
    "slo.ttft_s=0.5",
    "slo.tpot_s=0.05",
)


# executor=vllm on CPU (size=cpu): real vLLM instances on one core each (two cores: 1P1D against two
# colocated and two chunked instances), the test checkpoint's 30 layers at rates one core serves
VLLM_CPU_BASE = (
    "hardware=cpu",
    "hardware.num_devices=2",
    "model.name=tiny",  # the own engine's model is not what runs; vllm.model is
    "workload.num_requests=24",
    "workload.rate=0.5",
    "workload.length_scale=1.0",
    "workload.input_len.dist=uniform",
    "workload.input_len.min=32",
    "workload.input_len.max=384",
    "workload.output_len.dist=uniform",
    "workload.output_len.min=8",
    "workload.output_len.max=40",
    "scheduler.chunk_size=64",
    "slo.ttft_s=1.0",
    "slo.tpot_s=0.15",
)
VLLM_TINY = (
    "experiment.figures=false",
    "experiment.repeats=1",
    "experiment.search_points=0",
    "experiment.rates=[1.0]",
    "workload.num_requests=4",
)


def study(name: str) -> Study:
    if name not in BY_NAME:
        raise ConfigError(f"experiment.name={name!r} is not one of {', '.join(BY_NAME)}")
    return BY_NAME[name]


def tiny_values(chosen: Study) -> list[str]:
    """What `size=tiny` adds on top of the study's CPU size (testbed/sizing.py)."""
    return [*TINY_BASE, *chosen.tiny]


def tiny_overrides(name: str, *extra: str) -> list[str]:
    """The command line of the study's tiny run (the tests' and `python -m analysis.render`'s),
    before testbed/sizing.py adds the size's values."""
    return [f"+experiment={name}", "size=tiny", *extra]
