"""Every study reproduces the phenomenon it exists to show, simulated on an analytical H100 with
the Llama-3-8B shape: the direction of each anchor's result, not its numbers.

    interference   colocated inflation rises with prefill length; chunked stays below colocated at
                   the longest; disaggregation within 10% of 1.0 (DistServe section 2)
    chunk_sweep    TTFT falls and ITL p99 rises as the chunk budget grows (Sarathi-Serve)
    rate_sweep     attainment falls with rate; at a tight TPOT SLO with long prompts, disaggregation's
                   goodput per GPU beats colocated (DistServe)
    slo_scale      at a tight TPOT disaggregation keeps attainment colocated loses; loose SLOs close the gap
    ratio_sweep    prefill-heavy traffic wants more P than D, decode-heavy more D than P, and the
                   planner's analytical split agrees in direction
    input_buckets  TTFT rises with the input-length bucket
    burstiness     tail TTFT rises as arrivals get burstier
    multiturn      later turns reach their first token sooner with prefix caching
    kv_bandwidth   the connector approaches the raw link as messages grow (measured over gloo)
"""

from __future__ import annotations

import statistics

import numpy as np
import pytest

from testbed.config import register_configs
from testbed.sizing import compose_sized
from testbed.studies.runner import run

register_configs()

pytestmark = pytest.mark.slow

GPU_SIM = [
    "executor=sim",
    "sim.profile=h100_sxm",
    "model=llama3_8b",
    "hardware=cpu",
    "experiment.repeats=1",
    "experiment.figures=false",
]
LONG_PROMPTS = ["workload=poisson", "workload.input_len.dist=uniform", "workload.output_len.dist=uniform"]


def simulate(name: str, out, *extra: str) -> dict:
    overrides = [f"+experiment={name}", *GPU_SIM, *extra]
    return run(compose_sized(overrides), out)


def column(result: dict, axis: str, figure: str, label: str | None = None) -> list[float]:
    table = result["table"]
    if label is not None:
        table = table[table["label"] == label]
    return table.sort_values(axis)[figure].tolist()


def falls(values, slack: float = 0.0) -> bool:
    return all(b <= a * (1 + slack) for a, b in zip(values, values[1:])) and values[-1] < values[0]


def test_interference_rises_with_prefill_length_only_where_phases_share_a_device(tmp_path):
    result = simulate(
        "interference",
        tmp_path,
        "hardware.num_devices=2",
        "experiment.own.prefill_lengths=[512,2048,8192]",
        "workload.num_requests=6",
    )
    inflation = {
        label: {int(k): v["inflation"] for k, v in lengths.items() if k != "0"}
        for label, lengths in result["aggregate"]["interference"].items()
    }
    colocated = [inflation["colocated"][n] for n in (512, 2048, 8192)]
    assert colocated[0] < colocated[1] < colocated[2] and colocated[0] > 1.5, inflation
    assert inflation["chunked"][8192] < inflation["colocated"][8192], inflation
    assert all(abs(v - 1.0) <= 0.10 for v in inflation["1P1D"].values()), inflation


def test_chunk_budget_trades_ttft_for_itl(tmp_path):
    result = simulate("chunk_sweep", tmp_path, "experiment.own.chunk_sizes=[128,512,2048]", "workload.num_requests=100")
    assert falls(column(result, "chunk", "ttft_p50"), slack=0.02)
    itl = column(result, "chunk", "itl_p99")
    assert falls(itl[::-1], slack=0.02), itl  # rises with the budget


def test_rate_sweep_disaggregation_wins_goodput_at_a_tight_tpot_with_long_prompts(tmp_path):
    result = simulate(
        "rate_sweep",
        tmp_path,
        "hardware.num_devices=2",
        "experiment.modes=[colocated,disagg]",
        "experiment.rates=[2,8,32]",
        "workload.num_requests=100",
        *LONG_PROMPTS,
        "workload.input_len.min=2000",
        "workload.input_len.max=4000",
        "workload.output_len.min=64",
        "workload.output_len.max=256",
        "slo.ttft_s=1.0",
        "slo.tpot_s=0.012",
    )
    for label in ("colocated", "1P1D"):
        assert falls(column(result, "rate", "slo_attainment", label)), label
    goodput = result["aggregate"]["goodput"]
    assert goodput["1P1D"]["goodput_per_gpu"] > goodput["colocated"]["goodput_per_gpu"], goodput


def test_disaggregation_holds_attainment_at_a_tight_tpot_where_colocated_loses_it(tmp_path):
    """The gap is interference, not the SLO's arithmetic: at a tight TPOT colocated decodes stall
    behind long prefills and miss it while disaggregated ones meet it; loosen the SLOs fourfold and
    both meet them, so the gap closes."""
    result = simulate(
        "slo_scale",
        tmp_path,
        "hardware.num_devices=2",
        "experiment.modes=[colocated,disagg]",
        "workload.num_requests=100",
        "workload.rate=10",
        *LONG_PROMPTS,
        "workload.input_len.min=2000",
        "workload.input_len.max=4000",
        "workload.output_len.min=64",
        "workload.output_len.max=256",
        "slo.ttft_s=1.0",
        # tight against vllm_v1's decode step (6.5 ms: async scheduling hides the host time) plus
        # one prefill's stall; 12 ms was tight for a step of 8.9 ms with the host in sequence
        "slo.tpot_s=0.009",
        "experiment.own.slo_scales=[1.0,4.0]",
    )
    curves = {label: dict(zip(c["scales"], c["attainment"])) for label, c in result["aggregate"]["curves"].items()}
    assert curves["1P1D"][1.0] - curves["colocated"][1.0] >= 0.3, curves
    assert abs(curves["1P1D"][4.0] - curves["colocated"][4.0]) <= 0.05, curves


# decode-heavy traffic on an H100 is bound by decode slots, not by the TPOT SLO (a step reads the
# weights whatever the batch): with 8 running sequences per worker a split with fewer D queues
PHASE = {
    "prefill": (
        [
            "workload.input_len.min=3000",
            "workload.input_len.max=6000",
            "workload.output_len.min=4",
            "workload.output_len.max=16",
        ],
        "[8,32]",
    ),
    "decode": (
        [
            "workload.input_len.min=32",
            "workload.input_len.max=128",
            "workload.output_len.min=200",
            "workload.output_len.max=400",
            "scheduler.max_running=8",
        ],
        "[2,8]",
    ),
}


@pytest.mark.parametrize("shape,want", [("prefill", "more P"), ("decode", "more D")])
def test_best_split_follows_the_heavier_phase_and_the_planner_agrees(tmp_path, shape, want):
    lengths, rates = PHASE[shape]
    result = simulate(
        "ratio_sweep",
        tmp_path,
        "hardware.num_devices=4",
        "workload.num_requests=80",
        *LONG_PROMPTS,
        *lengths,
        f"experiment.rates={rates}",
        "slo.ttft_s=1.0",
        "slo.tpot_s=0.05",
    )
    goodput = {k: v for k, v in result["aggregate"]["goodput"].items() if "P" in k}
    assert not any(g["goodput_censored"] for g in goodput.values()), goodput  # a tie at a bound says nothing
    splits = {k: v["goodput_per_gpu"] for k, v in goodput.items()}
    best = max(splits, key=splits.get)
    p, d = (int(x) for x in best.rstrip("D").split("P"))
    assert (p > d) if want == "more P" else (d > p), splits
    planned = simulate(
        "plan",
        tmp_path / "plan",
        "hardware.num_devices=4",
        "workload.num_requests=80",
        *LONG_PROMPTS,
        *lengths,
        "experiment.rates=[8]",
        "experiment.own.chunk_sizes=[512]",
        "slo.ttft_s=1.0",
        "slo.tpot_s=0.05",
    )
    p, d = (int(x) for x in planned["aggregate"]["analytical"]["split"].rstrip("D").split("P"))
    assert (p > d) if want == "more P" else (d > p), planned["aggregate"]["analytical"]


def test_ttft_rises_with_the_input_bucket(tmp_path):
    result = simulate(
        "input_buckets", tmp_path, "hardware.num_devices=2", "experiment.modes=[chunked]", "workload.num_requests=200"
    )
    points = result["aggregate"]["points"]
    (cell,) = points.values()
    buckets = [cell.get(f"ttft_by_bucket_{b}_p50") for b in ("0-1K", "1K-4K", "4K-16K", "16K+")]
    known = [b for b in buckets if b is not None and np.isfinite(b)]
    assert len(known) >= 3 and falls(known[::-1]), buckets


def test_tail_ttft_rises_with_burstiness(tmp_path):
    result = simulate(
        "burstiness",
        tmp_path,
        "hardware.num_devices=2",
        "experiment.modes=[chunked]",
        "experiment.own.burstiness=[4.0,1.0,0.25]",
        "workload.num_requests=200",
        "workload.rate=30",
    )
    ttft = column(result, "burstiness", "ttft_p99")  # from burstiest (gamma shape 0.25) to smoothest
    assert falls(ttft, slack=0.05), ttft


def test_prefix_caching_speeds_up_later_turns(tmp_path):
    on = simulate(
        "multiturn",
        tmp_path / "on",
        "hardware.num_devices=2",
        "experiment.modes=[chunked]",
        "experiment.own.dispatch=[session_affinity]",
        "workload.num_requests=16",
    )
    off = simulate(
        "multiturn",
        tmp_path / "off",
        "hardware.num_devices=2",
        "experiment.modes=[chunked]",
        "experiment.own.dispatch=[session_affinity]",
        "workload.num_requests=16",
        "engine.enable_prefix_caching=false",
    )
    turns_on, turns_off = (next(iter(r["aggregate"]["turns"].values()))["ttft_mean_by_turn"] for r in (on, off))
    later = [t for t in turns_on if int(t) >= 2 and t in turns_off]
    assert later and all(turns_on[t] < turns_off[t] for t in later), (turns_on, turns_off)


def test_connector_approaches_the_raw_link_as_messages_grow(tmp_path):
    """Measured, not simulated (gloo between two CPU processes): per-message costs dominate small
    KV messages; at the largest the connector's pipelined pieces come close to a raw send."""
    from tests.study_runs import run_study

    result = run_study("kv_bandwidth", tmp_path, "experiment.own.message_mib=4")
    rows = sorted(result["aggregate"]["rows"], key=lambda r: r["bytes"])
    ratios = [r["ratio_best"] for r in rows]
    # the claim is the trend, measured in one run: the larger half of the sizes sits above the
    # smaller half. An absolute floor is the benchmark's to print (python -m testbed.measure.kv_transfer).
    # On a loaded machine a median draw can be a scheduler's hiccup, so each size is taken at its
    # best draw and the halves compared by their medians
    half = len(ratios) // 2
    assert statistics.median(ratios[half:]) > statistics.median(ratios[:half]), ratios
