"""`+experiment=replay`: a real engine's benchmark run replayed in the simulator (and, where the
CPU can, in emulation), and the relative error of each figure.

    python -m testbed +experiment=replay experiment.own.reference=<result file> experiment.own.setup=<setup.yaml>

The reference is a vLLM `bench serve` JSON or SGLang `bench_serving` JSONL (testbed/interop/
reference.py says how each client's definitions convert). The setup YAML says what the result
file does not: the GPU, the model, the engine's knobs (SETUP_KEYS below). The workload is
rebuilt from the reference: with per-request lists, each request's prompt and output length and
(where the file has send times) its arrival, as a native trace; without them, the request count
and rate of the file and the length distributions the setup states (the published run's
dataset, e.g. ShareGPT's, which the file does not carry).

Written to the run directory: sim/ (the simulated point, a results directory), replay.json
(every figure real, simulated and their relative error; what was not modelled), replay.csv and
replay.png (sim beside real). The engine's host side is stated in the setup, each key a knob of
the simulator: `host_overhead_s` and `host_overhead_per_seq_s` (the cost model's per-step host
term: scheduling, sampling, detokenising outside the kernels, engine.host_overhead_s and
engine.host_overhead_per_seq_s; unset, the GPU table's 2 ms a step and nothing per sequence),
`frontend_latency_s` (the engine's front end per request, sim.frontend_latency_s),
`num_scheduler_steps` (multi-step scheduling) and `cuda_graphs`.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import yaml

from testbed.config import Config, with_overrides
from testbed.errors import ConfigError
from testbed.interop.reference import FIGURES, STATS, Reference, read_reference, relative_error, trace_rows
from testbed.metrics.latency import distribution
from testbed.metrics.results_dir import write_json, write_text
from testbed.model.config import PRESETS, hf_model_args
from testbed.perf.gpus import GPUS
from testbed.perf.precision import KV_DTYPES, WEIGHT_DTYPES, check_dtype
from testbed.sim.engine_profile import engine_profile, for_engine
from testbed.studies.study import Study
from testbed.tracking.run_meta import CHECKOUT

log = logging.getLogger("testbed")

SETUP_KEYS = {
    "profile": "the engine profile to use (sim.engine_profile), where no profile covers `engine`",
    "engine": "the real engine and version (vllm 0.15.1): picks the engine profile (sim.engine_profile) whose host "
    "terms, front end and scheduling the setup's null keys take",
    "gpu": "a GPU of the analytical table (a100_80g, h100_sxm, ...)",
    "tp": "tensor-parallel degree of the engine (--tp / --tensor-parallel-size): the devices it spans",
    "model": "a preset (llama3_8b, qwen2_5_7b, ...)",
    "model_config": "a Hugging Face config.json (path relative to the setup file); replaces `model`",
    "dtype": "float16 | bfloat16 (2 bytes) | float32",
    "max_model_len": "the engine's --max-model-len",
    "policy": "colocated (prefill steps apart from decode steps: vLLM V0 default, SGLang) | chunked | disagg "
    "(prefill and decode instances: num_prefill, num_decode, each of `tp` GPUs)",
    "num_prefill": "disagg: prefill instances (default 1)",
    "num_decode": "disagg: decode instances (default 1)",
    "prefill_tp": "disagg: each prefill instance's tensor-parallel degree where it differs from `tp`",
    "decode_tp": "disagg: each decode instance's tensor-parallel degree where it differs from `tp`",
    "replicas": "colocated | chunked: engine replicas behind one router, each of `tp` GPUs (default 1)",
    "nodes": "disagg: 2 when prefill and decode run on different nodes (the KV crosses the network between them)",
    "internode_gbps": "the network between the nodes, GB/s (bytes): hardware.internode_gbps",
    "internode_latency_s": "its latency per KV transfer: hardware.internode_latency_s",
    "weight_bits": "a quantized checkpoint's bits per layer weight (GPTQ/AWQ int4: 4): sim.weight_bits",
    "weight_dtype": "the layer weights' type (fp8: an FP8 checkpoint, GEMMs at the FP8 peak): sim.weight_dtype",
    "kv_dtype": "the KV cache's type (fp8: vLLM --kv-cache-dtype fp8): sim.kv_dtype",
    "first_token": "disagg: prefill (the client's first token is the one the prefill instance makes, as here) | "
    "decode (a proxy streams the decode instance's tokens only: the first arrives after the KV, from D's first step)",
    "gpu_memory_utilization": "the engine's --gpu-memory-utilization: each GPU's share for weights and KV, which "
    "sizes the KV pool (engine.gpu_memory_utilization); unset: the testbed's default",
    "max_batched_tokens": "a step's token budget (vLLM max_num_batched_tokens; SGLang chunked_prefill_size)",
    "max_running": "running sequences at most (vLLM max_num_seqs; SGLang max_running_requests)",
    "prefix_caching": "the engine's prefix cache on (true) or off",
    "host_overhead_s": "per-step host time, fixed part (engine.host_overhead_s); null: the GPU table's 2 ms",
    "host_overhead_per_seq_s": "per-step host time per sequence sampled (engine.host_overhead_per_seq_s); null: 0",
    "frontend_latency_s": "the engine's front end per request: HTTP, tokenising, the hop to the scheduler "
    "(sim.frontend_latency_s); null: 0",
    "num_scheduler_steps": "vLLM --num-scheduler-steps: decode steps per schedule (sim.num_scheduler_steps); 1: off",
    "cuda_graphs": "decode steps replayed from CUDA graphs (false: vLLM --enforce-eager); null: on",
    "workload": "lengths and arrival when the reference has no per-request lists",
    "unmodelled": "engine settings the simulator cannot express (listed in the report)",
    "seed": "the synthetic workload's seed",
}
POLICIES = ("colocated", "chunked", "disagg")
SESSION_KEYS = ("turns", "system_prompt_len", "think_time_s", "think_time_dist")
SECONDS = ("host_overhead_s", "host_overhead_per_seq_s", "frontend_latency_s")
# the fitted knobs (testbed/studies/validation_set.py): a replay may replace the setup's; a
# disaggregated setup's hand-off path (its network, and whatever the engine's transfer adds) too
HOST = ("host_overhead_s", "host_overhead_per_seq_s", "frontend_latency_s")
LINK = ("internode_gbps", "internode_latency_s")
FITTED = HOST + LINK
DTYPES = {
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float32": "float32",
    "fp32": "float32",
}


def load_setup(path) -> dict:
    """The setup YAML, checked: unknown keys and values out of range are refused by name."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"experiment.own.setup={str(path)!r}: no such file")
    setup = yaml.safe_load(path.read_text()) or {}
    if not isinstance(setup, dict):
        raise ConfigError(f"{path}: expected a mapping of setup keys ({', '.join(SETUP_KEYS)})")
    unknown = sorted(set(setup) - set(SETUP_KEYS))
    if unknown:
        raise ConfigError(f"{path}: unknown setup key(s) {unknown}; known: {', '.join(SETUP_KEYS)}")
    if setup.get("gpu") not in GPUS:
        raise ConfigError(f"{path}: gpu={setup.get('gpu')!r} is not one of {', '.join(sorted(GPUS))}")
    tp = setup.get("tp", 1)
    if not (isinstance(tp, int) and not isinstance(tp, bool) and tp >= 1):
        raise ConfigError(f"{path}: tp={tp!r} must be an integer >= 1 (the engine's tensor-parallel degree)")
    if setup.get("policy", "colocated") not in POLICIES:
        raise ConfigError(f"{path}: policy={setup['policy']!r} is not one of {', '.join(POLICIES)}")
    if str(setup.get("dtype", "bfloat16")).lower() not in DTYPES:
        raise ConfigError(f"{path}: dtype={setup['dtype']!r} is not one of {', '.join(DTYPES)}")
    if "model_config" not in setup and setup.get("model", "llama3_8b") not in PRESETS:
        raise ConfigError(
            f"{path}: model={setup.get('model')!r} is not a preset ({', '.join(PRESETS)}); "
            f"or give model_config: <config.json>"
        )
    for key in SECONDS:
        value = setup.get(key)
        if value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0):
            raise ConfigError(f"{path}: {key}={value!r} must be a number of seconds >= 0")
    for key in ("num_prefill", "num_decode", "nodes", "replicas", "prefill_tp", "decode_tp"):
        value = setup.get(key, 1)
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            raise ConfigError(f"{path}: {key}={value!r} must be an integer >= 1")
    if setup.get("first_token", "prefill") not in ("prefill", "decode"):
        raise ConfigError(f"{path}: first_token={setup['first_token']!r} is not one of prefill, decode")
    if setup.get("weight_bits") not in (None, 4, 8, 16):
        raise ConfigError(f"{path}: weight_bits={setup['weight_bits']!r} is not one of 4, 8, 16, null")
    check_dtype(str(setup.get("weight_dtype", "auto")), f"{path}: weight_dtype", WEIGHT_DTYPES)
    check_dtype(str(setup.get("kv_dtype", "auto")), f"{path}: kv_dtype", KV_DTYPES)
    steps = setup.get("num_scheduler_steps", 1)
    if not (isinstance(steps, int) and not isinstance(steps, bool) and steps >= 1):
        raise ConfigError(f"{path}: num_scheduler_steps={steps!r} must be an integer >= 1")
    if setup.get("cuda_graphs") not in (None, True, False):
        raise ConfigError(f"{path}: cuda_graphs={setup['cuda_graphs']!r} must be true, false or null")
    setup["_profile"] = setup_profile(setup, path)
    setup["_dir"] = str(path.parent)
    return setup


def setup_profile(setup: dict, path: Path) -> Optional[str]:
    """The engine profile a setup names (`profile: NAME`), else the one covering its `engine`; an
    engine at a version no profile covers, without `profile:`, is refused in one line."""
    if setup.get("profile") is not None:
        return engine_profile(str(setup["profile"]), f"{path}: profile").name
    if not setup.get("engine"):
        return None
    try:
        return for_engine(setup["engine"], f"{path}: engine")
    except ConfigError as e:
        raise ConfigError(f"{e}; or name one with profile: NAME") from None


def model_overrides(setup: dict) -> dict:
    """model.* settings for the setup's model: a preset, or a config.json's shape on top of one."""
    out = {
        "model.name": setup.get("model", "llama3_8b"),
        "model.dtype": DTYPES[str(setup.get("dtype", "bfloat16")).lower()],
    }
    if "model_config" in setup:
        config = Path(setup["_dir"]) / setup["model_config"]
        args = hf_model_args(config.parent) if config.name == "config.json" else None
        if args is None:
            raise ConfigError(f"model_config={setup['model_config']!r} must name a config.json")
        out["model.name"] = "llama3_8b"
        for key in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "max_model_len",
            "rope_theta",
            "rms_norm_eps",
            "tie_embeddings",
            "qkv_bias",
            "head_dim",
        ):
            out[f"model.{key}"] = getattr(args, key)
    if setup.get("max_model_len"):
        out["model.max_model_len"] = int(setup["max_model_len"])
    return out


def instances(setup: dict) -> dict:
    """The workers a setup runs: one engine of `tp` GPUs, or disagg's prefill and decode instances
    (each of `tp` GPUs, on `nodes` nodes: P's first, so with two nodes the KV crosses the network)."""
    tp = setup.get("tp", 1)  # an integer >= 1 (load_setup)
    if setup.get("policy") != "disagg":
        n = setup.get("replicas", 1)
        return {"cluster.num_workers": n, "cluster.tp": tp, "hardware.num_devices": n * tp}
    p, d = setup.get("num_prefill", 1), setup.get("num_decode", 1)
    ptp, dtp = setup.get("prefill_tp", tp), setup.get("decode_tp", tp)
    out = {
        "cluster.num_prefill": p,
        "cluster.num_decode": d,
        "cluster.prefill_tp": ptp,
        "cluster.decode_tp": dtp,
        "hardware.num_devices": p * ptp + d * dtp,
        "hardware.num_nodes": setup.get("nodes", 1),
    }
    for key in ("internode_gbps", "internode_latency_s"):
        if setup.get(key) is not None:
            out[f"hardware.{key}"] = setup[key]
    return out


def point_overrides(ref: Reference, setup: dict, trace: Optional[Path]) -> tuple[dict, list[str]]:
    """The simulated point's settings, and the notes on what the replay could not express."""
    notes = [f"not modelled: {item}" for item in setup.get("unmodelled") or []] + list(ref.notes)
    policy = setup.get("policy", "colocated")
    running = int(setup.get("max_running", 256))
    budget = int(setup.get("max_batched_tokens", 2048))
    profile = setup.get("_profile")
    front = setup.get("frontend_latency_s")  # null: the engine profile's (a fitted knob, 0 included, replaces it)
    if front is None:
        front = engine_profile(profile).frontend_latency_s if profile else 0.0
    out = {
        "executor": "sim",
        "sim.profile": setup["gpu"],
        "sim.weight_bits": setup.get("weight_bits"),
        "sim.weight_dtype": str(setup.get("weight_dtype", "auto")),
        "sim.kv_dtype": str(setup.get("kv_dtype", "auto")),
        "mode": policy,
        **instances(setup),
        "scheduler.max_running": running,
        "scheduler.max_batched_tokens": budget,
        "scheduler.chunk_size": max(budget, running),
        "engine.enable_prefix_caching": bool(setup.get("prefix_caching")),
        "engine.host_overhead_s": setup.get("host_overhead_s"),
        "engine.host_overhead_per_seq_s": float(setup.get("host_overhead_per_seq_s") or 0.0),
        "engine.cuda_graphs": setup.get("cuda_graphs"),
        "sim.frontend_latency_s": float(front),
        "sim.engine_profile": profile,
        "sim.num_scheduler_steps": int(setup.get("num_scheduler_steps", 1)),
        "sim.step_gap_s": 0.0,
        "seed": int(setup.get("seed", 0)),
        "experiment.figures": False,
        **model_overrides(setup),
    }
    if setup.get("gpu_memory_utilization") is not None:
        out["engine.gpu_memory_utilization"] = float(setup["gpu_memory_utilization"])
    if ref.max_concurrency:  # the client's users: a closed loop (TTFT from the send, after the wait, as vLLM's)
        out.update(client_loop(ref, trace))
        paced = ", paced by its sends" if out["workload.paced"] else ""
        notes.append(f"closed loop: the client's {ref.max_concurrency} users{paced}")
    if trace is not None:
        out.update(
            {
                "workload.path": str(trace),
                "workload.format": "native_jsonl",
                "workload.arrival": "trace",
                "workload.num_requests": 0,
                "workload.overlength": "clip",
            }
        )
        return out, notes
    work = dict(setup.get("workload") or {})
    count = int(work.pop("num_requests", ref.num_requests or 0))
    if count <= 0:
        raise ConfigError(f"{ref.path}: no request count in the file; give workload.num_requests in the setup")
    rate = ref.rate
    if math.isnan(rate):
        raise ConfigError(f"{ref.path}: no request rate in the file; a trace replay needs the trace")
    arrival = work.pop("arrival", ref.arrival or ("gamma" if ref.burstiness != 1.0 else "poisson"))
    if math.isinf(rate):  # every request at once: a rate far above what any engine serves
        rate, arrival = 1e6, "constant"
        notes.append("request_rate=inf: every request sent at once (arrivals 1 us apart)")
    out.update(
        {
            "workload.num_requests": count,
            "workload.rate": rate,
            "workload.arrival": arrival,
            "workload.burstiness": ref.burstiness,
            "workload.overlength": "clip",
        }
    )
    for key in ("input_len", "output_len"):
        for field, value in (work.pop(key, None) or {}).items():
            out[f"workload.{key}.{field}"] = value
    for key in SESSION_KEYS:  # multi-turn sessions sharing a system prompt (prefix caching serves it)
        if key in work:
            out[f"workload.{key}"] = work.pop(key)
    if work:
        raise ConfigError(
            f"setup workload: unknown key(s) {sorted(work)} (num_requests, arrival, input_len, "
            f"output_len, {', '.join(SESSION_KEYS)})"
        )
    notes.append(
        "lengths drawn from the setup's distributions (the file has no per-request lengths): "
        "the real run's own requests differ"
    )
    return out, notes


def client_loop(ref: Reference, trace: Optional[Path]) -> dict:
    """The client's --max-concurrency N (GuideLLM: N concurrent streams) as N closed-loop users,
    each sending its next request when its last one ended; where the client also paced its sends
    (a finite rate, or a trace's send times) the sends keep that pace and the users cap it."""
    return {
        "workload.concurrency": int(ref.max_concurrency),
        "workload.paced": trace is not None or math.isfinite(ref.rate),
        "workload.think_time_s": 0.0,
    }


def decode_first(summary: dict, requests) -> dict:
    """The simulated run as a client behind a disaggregating proxy sees it: its first token is the
    decode worker's first (the request's second here, after the KV arrived), its TPOT the mean gap
    over the decode worker's tokens after that one."""
    ok = requests[requests["status"] == "ok"]
    times = [list(t) for t in ok["token_times"]]
    first = [t[1] - t[0] if len(t) > 1 else float("nan") for t in times]
    ttft = ok["ttft"].to_numpy(dtype=float) + np.asarray(first, dtype=float)
    tpot = [(t[-1] - t[1]) / (len(t) - 2) if len(t) > 2 else float("nan") for t in times]
    return {**summary, "ttft": distribution(ttft), "tpot": distribution(tpot)}


def comparison(ref: Reference, sim_summary: dict) -> list[dict]:
    """One row per figure: real, simulated (seconds or per second) and (sim - real) / real."""
    rows = []
    for name in FIGURES:
        for stat in STATS:
            real = ref.figures[name].get(stat)
            sim = _finite((sim_summary.get(name) or {}).get(stat))
            rows.append({"figure": f"{name}_{stat}", "real": real, "sim": sim, "error": relative_error(sim, real)})
    for key in ("requests_per_s", "output_tokens_per_s"):
        real = ref.throughput.get(key)
        sim = _finite((sim_summary.get("throughput") or {}).get(key))
        rows.append({"figure": f"throughput_{key}", "real": real, "sim": sim, "error": relative_error(sim, real)})
    return rows


def _finite(value) -> Optional[float]:
    return float(value) if value is not None and math.isfinite(float(value)) else None


def error_table(rows: list[dict]) -> str:
    """The rows as a fixed-width table (ms for latencies), '-' where a side has no figure."""
    lines = [f"{'figure':<32}{'real':>12}{'sim':>12}{'error':>10}"]
    for row in rows:
        scale, unit = (1000.0, " ms") if not row["figure"].startswith("throughput") else (1.0, " /s")
        show = lambda v: "-" if v is None else f"{v * scale:.2f}"  # noqa: E731
        error = "-" if row["error"] is None else f"{100 * row['error']:+.1f}%"
        lines.append(f"{row['figure'] + unit:<32}{show(row['real']):>12}{show(row['sim']):>12}{error:>10}")
    return "\n".join(lines)


def mape(rows: list[dict], figures=None) -> Optional[float]:
    """Mean absolute relative error over the rows that have both sides (of `figures`, if given)."""
    errors = [abs(r["error"]) for r in rows if r["error"] is not None and (figures is None or r["figure"] in figures)]
    return sum(errors) / len(errors) if errors else None


def draw(rows: list[dict], path: Path, title: str) -> Optional[Path]:
    """Sim beside real, one pair of bars per figure that has both (log scale: ms span decades)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pairs = [
        r for r in rows if r["real"] is not None and r["sim"] is not None and not r["figure"].startswith("through")
    ]
    if not pairs:
        return None
    fig, ax = plt.subplots(figsize=(max(4.0, 0.7 * len(pairs)), 3.2))
    x = range(len(pairs))
    ax.bar([i - 0.2 for i in x], [1000 * r["real"] for r in pairs], 0.4, label="real")
    ax.bar([i + 0.2 for i in x], [1000 * r["sim"] for r in pairs], 0.4, label="sim")
    ax.set_xticks(list(x))
    ax.set_xticklabels([r["figure"] for r in pairs], rotation=45, ha="right", fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("ms")
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def replay(
    cfg: Config,
    reference,
    setup_path,
    out_dir: Path,
    run_point: Callable,
    *,
    knobs: Optional[dict] = None,
    emulate: bool = False,
    quiet: bool = False,
) -> dict:
    """Replay one reference run; `knobs` (FITTED keys, when given) replace the setup's."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ref = read_reference(reference)
    setup = load_setup(setup_path)
    unknown = sorted(set(knobs or {}) - set(FITTED))
    if unknown:
        raise ConfigError(f"replay knobs {unknown}: only {', '.join(FITTED)} are fitted")
    setup.update(knobs or {})
    trace = None
    if ref.detailed:
        trace = out_dir / "reference_trace.jsonl"
        write_text(trace, "".join(json.dumps(row) + "\n" for row in trace_rows(ref.requests)))
    overrides, notes = point_overrides(ref, setup, trace)
    sim = run_point(with_overrides(cfg, overrides), out_dir / "sim")
    summary = sim["summary"]
    if setup.get("policy") == "disagg" and setup.get("first_token") == "decode":
        summary = decode_first(summary, sim["requests"])
        notes.append(
            "first_token=decode: TTFT read at the decode worker's first token, TPOT over its tokens after it "
            "(the client sees only the decode instance's stream)"
        )
    rows = comparison(ref, summary)
    emulated = None
    if emulate:
        emulated, note = emulate_point(cfg, overrides, out_dir, run_point)
        notes.append(note)
        if emulated is not None:
            for row, emu in zip(rows, comparison(ref, emulated["summary"])):
                row["emulated"], row["emulated_error"] = emu["sim"], emu["error"]
    title = f"{Path(str(reference)).name} on {setup['gpu']}"
    figure = draw(rows, out_dir / "replay.png", title)
    result = {
        "reference": str(reference),
        "setup": str(setup_path),
        "format": ref.format,
        "detailed": ref.detailed,
        "definitions": ref.definitions,
        "gpu": setup["gpu"],
        "engine_profile": setup.get("_profile"),
        "knobs": {key: setup.get(key) for key in FITTED},
        "overrides": overrides,
        "notes": notes,
        "rows": rows,
        "mape": mape(rows),
        "figure": str(figure) if figure else None,
    }
    write_json(out_dir / "replay.json", result)
    write_text(
        out_dir / "replay.csv",
        "figure,real,sim,error\n"
        + "".join(f"{r['figure']},{_csv(r['real'])},{_csv(r['sim'])},{_csv(r['error'])}\n" for r in rows),
    )
    if not quiet:
        log.info(
            "replay of %s (%s, %s; engine profile %s)\n%s",
            reference,
            ref.format,
            "per-request" if ref.detailed else "summary-only",
            setup.get("_profile") or "none (the GPU table's host term)",
            error_table(rows),
        )
        for note in notes:
            log.info("  %s", note)
        log.info("results: %s", out_dir)
    return result


def _csv(value) -> str:
    return "" if value is None else repr(float(value))


EMULATE_MAX_REQUESTS = 64  # two CPU cores pace a GPU's steps in real time: a small run only


def emulate_point(cfg: Config, overrides: dict, out_dir: Path, run_point: Callable) -> tuple[Optional[dict], str]:
    """The same workload on the real engine paced as the GPU (hardware.emulate), the tiny model's
    compute standing in: only for a small synthetic workload (at most EMULATE_MAX_REQUESTS), since
    it runs in real time on this machine. A tensor-parallel setup runs a real TP group of the tiny
    model, paced by the GPU's roofline at that degree."""
    count = int(overrides.get("workload.num_requests", 0))
    if overrides.get("workload.path") or not 0 < count <= EMULATE_MAX_REQUESTS:
        return None, (
            f"emulation skipped: it runs in real time on this CPU; only a synthetic workload of at most "
            f"{EMULATE_MAX_REQUESTS} requests is emulated (this one: "
            f"{'a trace' if overrides.get('workload.path') else count})"
        )
    emulated = {k: v for k, v in overrides.items() if not k.startswith(("sim.", "model."))}
    emulated.update(
        {
            "executor": "real",
            "hardware.emulate": overrides["sim.profile"],
            "hardware.emulate_model": overrides["model.name"],
            "model.name": "tiny",
            # the setup's FP8 weights and KV pace the real workers as they price the simulator's
            "hardware.emulate_weight_dtype": overrides.get("sim.weight_dtype", "auto"),
            "hardware.emulate_kv_dtype": overrides.get("sim.kv_dtype", "auto"),
        }
    )
    if emulated.get("engine.cuda_graphs"):  # the CPU engine has none; unset, the emulated GPU's decode has them
        emulated["engine.cuda_graphs"] = None
    left = [
        key for key in ("sim.frontend_latency_s", "sim.num_scheduler_steps") if overrides.get(key) not in (None, 0, 1)
    ]
    note = "emulated: hardware.emulate on the tiny model (the host terms and CUDA graphs pace it as in the simulator)"
    if left:
        note += f"; not emulated: {', '.join(left)} (the real engine's own front end and scheduler run)"
    return run_point(with_overrides(cfg, emulated), out_dir / "emulated"), note


@dataclass(frozen=True)
class Settings:
    """`experiment.own` of replay."""

    reference: Optional[str] = None  # a real engine's result file (vLLM bench serve JSON, SGLang bench_serving JSONL)
    setup: Optional[str] = None  # the reference run's setup YAML (GPU, model, engine knobs: SETUP_KEYS)
    # also run the workload in emulation (small synthetic workloads only: it runs in real time)
    replay_emulate: bool = False

    def validate(self) -> None:
        for key in ("reference", "setup"):
            if getattr(self, key) is not None and not isinstance(getattr(self, key), str):
                raise ConfigError(f"experiment.own.{key} must be a path (got {getattr(self, key)!r})")
        if not isinstance(self.replay_emulate, bool):
            raise ConfigError(f"experiment.own.replay_emulate must be true or false (got {self.replay_emulate!r})")


def run_replay(cfg: Config, out_dir: Path, run_point: Callable, session=None) -> dict:
    """The study: experiment.own.reference and experiment.own.setup are required."""
    exp = STUDY.own_settings(cfg)
    if not exp.reference or not exp.setup:
        raise ConfigError(
            "experiment=replay needs experiment.own.reference=<vLLM or SGLang result file> and "
            "experiment.own.setup=<setup.yaml> (see docs/validation.md)"
        )
    return replay(cfg, exp.reference, exp.setup, out_dir, run_point, emulate=exp.replay_emulate)


REPLAYED = CHECKOUT / "tests" / "data" / "replay"  # the replays stored in a checkout: the tiny size's
STUDY = Study(
    "replay",
    "a published engine's run replayed in the simulator, compared figure by figure",
    runs=run_replay,
    # a published GPU run replayed in the simulator (its workload is the reference's, not TINY_BASE's)
    tiny=(
        f"experiment.own.reference={REPLAYED / 'sglang030_a100_llama31_8b_rps4.jsonl'}",
        f"experiment.own.setup={REPLAYED / 'sglang030_a100.setup.yaml'}",
    ),
    settings=Settings,
)
