"""`experiment.dry_run=true`: what a study would run, printed, nothing run. The resolved model
(its shape and parameter count), the sizing decisions, the grid of points in the order they run
(mode, label, rate, repeat, seed) and an estimate of the time.

The estimate is rough, and said as such: a real point (executor=real, vllm, http) serves its
open-loop arrivals in real time, num_requests / rate seconds, plus REAL_POINT_S to start and drain
(the CPU main job: 81 points in 92 s, about 66 s of them arrivals); a simulated point costs
SIM_POINT_S plus SIM_REQUEST_S per request (ratio_sweep at size=tiny on two shared cores: 6 points
of 6 requests in 3-4 s, of 400 requests in 5-11 s). A closed loop, or a trace replayed on its own
times, has no arrival span to read here and counts its start alone. A goodput search adds up to
search_points points per configuration and repeat at rates the grid's results decide: the
estimate prices each like the grid's mean point (the CPU main job: 84 at most, 57 ran)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import yaml

from testbed.config import Config, with_overrides
from testbed.errors import TestbedError
from testbed.experiment import ONE_POINT
from testbed.perf.roofline import weight_params
from testbed.studies.catalog import simulates
from testbed.studies.machine import num_devices
from testbed.studies.repeats import with_repeats
from testbed.studies.study import Study
from testbed.studies.sweep import Point

REAL_POINT_S = 0.4  # a real point's start and drain on CPU workers, beyond its arrivals
SIM_POINT_S = 0.4  # a simulated point's set-up and results files
SIM_REQUEST_S = 0.001  # the simulator per request
COLUMNS = ("mode", "label", "rate", "repeat", "seed")


@dataclass(frozen=True)
class Estimate:
    grid_s: float  # every point of the grid
    search_s: float  # the most a goodput search can add
    search_points: int  # its most points


def show(study: Study, cfg: Config) -> dict:
    """Print the dry run and return what it printed, as data (the tests read it)."""
    points = grid(study, cfg)
    estimate = estimated(study, cfg, points)
    lines = [*model_lines(cfg), *sizing_lines(cfg), *point_lines(points, study), estimate_line(cfg, points, estimate)]
    print("\n".join(lines))
    return {"dry_run": True, "points": [p.name for p in points], "estimate": estimate, "lines": lines}


def job_text(study: Study, cfg: Config) -> str:
    """What `--cfg job` prints: the configuration that runs as YAML, resolved (the model's shape,
    engine.block_size and every other value the configuration decides), `experiment` with the
    study's own keys alone; then, as comments, the keys its points set, what was decided and
    why, and the dry run (model, sizing, the grid of points, the time estimate)."""
    config = asdict(cfg)
    runs_on = {"sim": simulates(cfg), "http": cfg.executor == "http", "vllm": cfg.executor == "vllm"}
    for section, runs in runs_on.items():
        if not runs:  # another executor's settings: not what runs
            config.pop(section)
    if "http" in config:
        config["http"]["api_key"] = "***" if cfg.http.api_key else None
    config["experiment"] = {key: config["experiment"][key] for key in study.experiment_keys}
    if study.settings is not None:  # a study module's own settings, its defaults filled in
        config["experiment"]["own"] = asdict(study.own_settings(cfg))
    args = cfg.model.args()
    resolved = {f.name: getattr(args, f.name) for f in fields(args) if config["model"].get(f.name, 0) is None}
    config["model"].update(resolved)  # the preset's shape, as the run resolves it
    points = grid(study, cfg)
    swept = sorted({key for p in points for key in p.overrides})
    timed = points or ([Point(ONE_POINT, {}, {})] if study.runs is None else [])  # the one point is timed too
    comments = [
        *([f"set per point by {study.name} (the grid below): {', '.join(swept)}"] if swept else []),
        *model_lines(cfg),
        *sizing_lines(cfg),
        *point_lines(points, study),
        estimate_line(cfg, timed, estimated(study, cfg, timed)),
    ]
    body = yaml.safe_dump(config, sort_keys=False, default_flow_style=False, width=120)
    return body + "\n".join(f"# {line}" for line in comments) + "\n"


def grid(study: Study, cfg: Config) -> list[Point]:
    """The points a run would run, in its order (before any goodput search)."""
    if study.runs is not None or not study.sweeps:
        return []
    return with_repeats(study.points(cfg), cfg)


def model_lines(cfg: Config) -> list[str]:
    a = cfg.model.args()
    shape = (
        f"{a.num_layers} layers, hidden {a.hidden_size}, {a.num_heads} heads ({a.num_kv_heads} KV) of {a.head_dim}, "
        f"MLP {a.intermediate_size}, vocab {a.vocab_size}, context {a.max_model_len}"
    )
    experts = f", {a.num_experts} experts (top {a.experts_per_token})" if a.num_experts else ""
    return [f"model: {cfg.model.path or cfg.model.name}: {shape}{experts}; {weight_params(a) / 1e9:.3g}B parameters"]


def sizing_lines(cfg: Config) -> list[str]:
    decided = "".join(f"; {key}={value} ({why})" for key, (value, why) in cfg.decided.items())
    return [
        f"size: {cfg.size}; executor={cfg.executor}, {num_devices(cfg)} devices, {cfg.workload.num_requests} "
        f"requests a point, {cfg.experiment.repeats} repeat(s){decided}"
    ]


def point_lines(points: list[Point], study: Study) -> list[str]:
    if not points and study.runs is None:
        return ["points: 1, the configuration as it is"]
    if not points:
        return ["points: the study decides its own points as it runs (not a grid): none listed"]
    axes = [k for k in dict.fromkeys(k for p in points for k in p.knobs) if k not in (*COLUMNS, "cell")]
    columns = [*COLUMNS[:2], *axes, *COLUMNS[2:]]
    rows = [[p.name, *(_cell(p.knobs.get(c)) for c in columns)] for p in points]
    widths = [max(len(r[i]) for r in [["point", *columns], *rows]) for i in range(len(columns) + 1)]
    table = [["point", *columns], *rows]
    return [f"points: {len(points)}"] + [
        "  " + "  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in table
    ]


def _cell(value) -> str:
    return "-" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def estimated(study: Study, cfg: Config, points: list[Point]) -> Estimate:
    grid_s = sum(point_seconds(cfg, p) for p in points)
    e = cfg.experiment
    if not study.searches_goodput or e.search_points == 0 or cfg.executor == "http":
        return Estimate(grid_s, 0.0, 0)
    searches = {(p.knobs.get("label"), p.knobs.get("repeat")) for p in points if "rate" in p.knobs}
    # a search point's rate is decided by the grid's results: priced like the grid's mean point
    count = e.search_points * len(searches)
    return Estimate(grid_s, count * grid_s / max(len(points), 1), count)


def point_seconds(cfg: Config, point: Point) -> float:
    try:
        ran = with_overrides(cfg, {k: v for k, v in point.overrides.items() if "{points}" not in str(v)})
    except TestbedError:
        ran = cfg
    w = ran.workload
    if ran.executor == "sim":
        return SIM_POINT_S + SIM_REQUEST_S * w.num_requests
    open_loop = w.num_requests and not w.concurrency and w.arrival != "trace"
    span = w.num_requests / w.rate if open_loop else 0.0
    return REAL_POINT_S + span


def estimate_line(cfg: Config, points: list[Point], estimate: Estimate) -> str:
    how = "simulator: per point and per request" if cfg.executor == "sim" else "arrivals in real time + start"
    search = (
        f", plus at most {estimate.search_points} goodput-search points (about {_duration(estimate.search_s)})"
        if estimate.search_points
        else ""
    )
    return f"estimate: about {_duration(estimate.grid_s)} for the {len(points)} points ({how}){search}"


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes} min {secs} s" if minutes else f"{secs} s"
