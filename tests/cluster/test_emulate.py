"""Emulated devices (hardware.emulate) and honest CPU runs: pacing on a fake clock, the config's
errors, the core plan, and a real 1P1D run held to a profile's step and link times."""

import dataclasses
import json
import logging
import os

import numpy as np
import pytest

from testbed import LLM, notices
from testbed.cluster import launcher
from testbed.cluster.emulation import Emulation, emulation_meta, role_pacers
from testbed.cluster.pacing import LinkPacer, StepPace, StepPacer, hold, pace_summary
from testbed.engine import Engine, EngineConfig, SchedulerConfig, Sequence
from testbed.errors import ConfigError
from testbed.metrics.record import StepRecord
from testbed.metrics.results_dir import read_results
from testbed.model.config import PRESETS
from testbed.perf import CostModel
from testbed.studies.real_cluster import serve
from testbed.workload import build_workload
from tests.cluster_helpers import make_config, small_workload
from tests.paths import ROOT

TINY_PROFILE = ROOT / "testbed" / "sim" / "profiles" / "tiny_cpu.json"
ZERO = dict(
    overhead_s=0.0,
    per_prefill_token_s=0.0,
    per_attended_pair_s=0.0,
    per_decode_seq_s=0.0,
    per_decode_context_token_s=0.0,
    transfer_latency_s=0.0,
    transfer_bytes_per_s=1e9,
)


def cost(**terms) -> CostModel:
    return CostModel(**{**ZERO, **terms})


def record(start=0.0, end=0.001, chunks=(), decodes=0, context=0) -> StepRecord:
    return StepRecord(
        start=start,
        end=end,
        role="chunked",
        prefill_tokens=sum(n for n, _ in chunks),
        decode_seqs=decodes,
        batched_tokens=0,
        kv_blocks_used=0,
        num_waiting=0,
        num_running=0,
        schedule_s=0,
        prepare_s=0,
        forward_s=end - start,
        sample_s=0,
        postprocess_s=0,
        prefill_chunks=tuple(chunks),
        decode_context=context,
    )


class FakeClock:
    def __init__(self, t: float = 0.0):
        self.t, self.sleeps = t, []

    def __call__(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.t += seconds


def test_modelled_step_time_reads_the_batch_shape():
    model = cost(
        overhead_s=0.01,
        per_prefill_token_s=1e-4,
        per_attended_pair_s=1e-7,
        per_decode_seq_s=1e-3,
        per_decode_context_token_s=1e-6,
    )
    chunks = [(100, 0), (50, 200)]
    expected = model.step_time(150, model.prefill_context(chunks), 3, 900)
    assert StepPacer(model).modelled_s(record(chunks=chunks, decodes=3, context=900)) == pytest.approx(expected)
    assert StepPacer(model).modelled_s(record(decodes=2, context=10)) == pytest.approx(0.01 + 2e-3 + 1e-5)


def test_sleep_is_the_modelled_time_left_and_a_slow_step_is_an_overrun():
    pacer = StepPacer(cost(overhead_s=0.02))
    fast, slow = pacer.pace(record(0.0, 0.005)), pacer.pace(record(1.0, 1.03))
    assert fast.sleep_s == pytest.approx(0.015) and not fast.overrun
    assert slow.sleep_s == 0.0 and slow.overrun
    assert StepPace(0.02, 0.02).sleep_s == 0.0 and not StepPace(0.02, 0.02).overrun


def test_time_lost_between_steps_counts_against_the_pace():
    """A worker that went straight on from the step that ended at 1.0: 12 ms of host work before
    the next step (a KV arrival, reports) leaves 3 ms of the 20 ms step to hold, and 25 ms lost
    (the process off its core) is an overrun, though the step itself took 5 ms."""
    pacer = StepPacer(cost(overhead_s=0.02))
    absorbed = pacer.pace(record(1.012, 1.017), since=1.0)
    assert absorbed.sleep_s == pytest.approx(0.003) and absorbed.until == pytest.approx(1.02)
    assert not absorbed.overrun
    lost = pacer.pace(record(1.025, 1.030), since=1.0)
    assert lost.overrun and lost.sleep_s == 0.0
    assert not pacer.pace(record(1.025, 1.030)).overrun  # after an idle wait: from the step's start
    assert not absorbed.late(1.029) and absorbed.late(1.031)  # a wake-up 11 ms after due: half the step lost
    assert absorbed.lost(1.031) and lost.lost(1.030) and not absorbed.lost(1.02)


def test_hold_sleeps_until_the_modelled_end_and_wakes_for_the_link():
    clock, polls = FakeClock(10.0), []
    link = LinkPacer(cost(transfer_latency_s=0.004))
    assert not link.arrived(7, 10.0, 0, now=10.0)  # booked: due at 10.004
    hold(10.010, clock, clock.sleep, poll=lambda: polls.append(clock()), wake=link.next_due)
    assert clock() == pytest.approx(10.010)
    assert clock.sleeps == pytest.approx([0.004, 0.006]) and polls == pytest.approx([10.004])
    assert link.arrived(7, 10.0, 0, now=clock())
    hold(5.0, clock, clock.sleep)  # already past: no sleep
    assert len(clock.sleeps) == 2


def test_link_runs_one_transfer_at_a_time_at_the_modelled_rate():
    link = LinkPacer(cost(transfer_latency_s=0.01, transfer_bytes_per_s=1e6), bytes_scale=2.0)
    assert link.modelled_s(1000) == pytest.approx(0.01 + 2000 / 1e6)
    assert not link.arrived(1, 0.0, 1000, now=0.0)  # due 0.012
    assert not link.arrived(2, 0.001, 1000, now=0.001)  # queued behind it: due 0.024
    assert link.next_due(0.005) == pytest.approx(0.012)
    assert not link.arrived(1, 0.0, 1000, now=0.0119) and link.arrived(1, 0.0, 1000, now=0.012)
    assert not link.arrived(2, 0.001, 1000, now=0.02) and link.arrived(2, 0.001, 1000, now=0.024)
    assert link.next_due(0.03) is None
    assert not link.arrived(1, 0.05, 1000, now=0.05)  # the same request sent again books anew


def test_pace_summary_counts_overruns():
    import pandas as pd

    rows = [
        record(0, real)._replace(modelled_s=0.02, pace_overrun=real > 0.02)._asdict()
        for real in (0.001, 0.03, 0.005, 0.04)
    ]
    summary = pace_summary(pd.DataFrame(rows))
    assert summary["steps"] == 4 and summary["overrun_steps"] == 2 and summary["overrun_share"] == 0.5
    assert summary["modelled_s_mean"] == pytest.approx(0.02)
    assert pace_summary(pd.DataFrame([record()._asdict()])) is None


def test_step_record_holds_the_cost_shape():
    args = dataclasses.replace(PRESETS["tiny"], max_model_len=256)
    scheduler = SchedulerConfig(chunk_size=32, max_running=8)
    engine = Engine.build(args, EngineConfig(num_kv_blocks=64), scheduler, "chunked")
    engine.add(Sequence(1, list(range(40)), 3))
    first = engine.step().record
    second = engine.step().record
    assert first.prefill_chunks == ((32, 0),) and first.decode_context == 0
    assert second.prefill_chunks == ((8, 32),)
    third = engine.step().record
    assert third.prefill_chunks == () and third.decode_seqs == 1 and third.decode_context == 41


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["hardware.emulate=missing/profile.json"], "neither a GPU of the analytical table"),
        (["hardware.emulate=h100"], "h100_sxm"),
        (["hardware.emulate_prefill=PROFILE"], "set both"),
        (["hardware.emulate_model=llama3_8b"], "needs hardware.emulate"),
        (["hardware.emulate=PROFILE", "hardware.emulate_model=huge"], "is not one of"),
    ],
)
def test_bad_emulation_settings_are_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message) as error:
        make_config(*[o.replace("PROFILE", str(TINY_PROFILE)) for o in overrides])
    assert "\n" not in str(error.value)


def test_a_measured_profile_paces_its_own_shape_only():
    tiny = make_config(f"hardware.emulate={TINY_PROFILE}")
    emulation = Emulation.from_hardware(tiny.hardware)
    step, link = role_pacers(emulation, "chunked", tiny.model, PRESETS["tiny"].kv_bytes_per_token * 4)
    assert link.bytes_scale == 1.0 and step.modelled_s(record(decodes=1, context=10)) > 0
    meta = emulation_meta(emulation, tiny.model, disagg=False)
    assert meta["prefill"] == meta["decode"]
    assert meta["prefill"]["kind"] == "measured" and meta["prefill"]["name"] == str(TINY_PROFILE)
    assert meta["model"]["modelled"]["shape"] == meta["model"]["run"]["shape"]
    big = make_config(f"hardware.emulate={TINY_PROFILE}", "hardware.emulate_model=llama3_8b")
    with pytest.raises(ConfigError, match="does not match"):
        emulation_meta(Emulation.from_hardware(big.hardware), big.model, disagg=True)


def test_an_ipc_link_is_paced_by_the_ipc_times(tmp_path):
    tiny = make_config(f"hardware.emulate={TINY_PROFILE}")
    emulation, real_kv = Emulation.from_hardware(tiny.hardware), PRESETS["tiny"].kv_bytes_per_token * 4
    _, wire = role_pacers(emulation, "prefill_only", tiny.model, real_kv)
    _, ipc = role_pacers(emulation, "prefill_only", tiny.model, real_kv, "ipc")
    cost = CostModel.from_profile(json.loads(TINY_PROFILE.read_text()))
    assert ipc.modelled_s(1 << 20) == pytest.approx(cost.transfer_time(1 << 20, "ipc"))
    assert wire.modelled_s(1 << 20) == pytest.approx(cost.transfer_time(1 << 20))
    old = json.loads(TINY_PROFILE.read_text())
    del old["samples"]["transfer_ipc"]
    old["cost_model"] = {k: v for k, v in old["cost_model"].items() if not k.startswith("ipc_")}
    (tmp_path / "old.json").write_text(json.dumps(old))
    before = make_config(f"hardware.emulate={tmp_path / 'old.json'}")
    old_device = Emulation.from_hardware(before.hardware)
    with pytest.raises(ConfigError, match="kv_transfer.backend=ipc: the emulated prefill device"):
        role_pacers(old_device, "prefill_only", before.model, real_kv, "ipc")
    role_pacers(old_device, "decode_only", before.model, real_kv, "ipc")  # D sends no KV
    role_pacers(old_device, "chunked", before.model, real_kv, "ipc")
    # refused before any worker starts, in one line
    cfg = make_config(f"hardware.emulate={tmp_path / 'old.json'}", "mode=disagg", "kv_transfer.backend=ipc")
    with pytest.raises(ConfigError, match="no ipc transfer samples") as refused:
        serve(cfg, tmp_path / "run", progress=False)
    assert "\n" not in str(refused.value) and not (tmp_path / "run" / "requests.parquet").exists()
    serve(
        make_config(
            f"hardware.emulate={tmp_path / 'old.json'}",
            "mode=colocated",
            "kv_transfer.backend=ipc",
            *small_workload(n=2),
        ),
        tmp_path / "colocated",
        progress=False,
    )  # no KV moves: runs


def test_a_gpu_name_paces_the_emulated_shape_and_its_kv_bytes():
    cfg = make_config("hardware.emulate=h100_sxm", "hardware.emulate_model=llama3_8b")
    emulation = Emulation.from_hardware(cfg.hardware)
    tiny_kv = PRESETS["tiny"].kv_bytes_per_token * 4  # float32 on CPU
    step, link = role_pacers(emulation, "decode_only", cfg.model, tiny_kv)
    assert link.bytes_scale == PRESETS["llama3_8b"].kv_bytes_per_token * 2 / tiny_kv  # bfloat16 on the GPU
    weights_s = 16e9 / 3.35e12  # an 8B decode step reads 16 GB of bf16 weights from 3.35 TB/s HBM
    assert weights_s < step.modelled_s(record(decodes=8, context=8 * 512)) < 20 * weights_s
    meta = emulation_meta(emulation, cfg.model, disagg=True)
    assert meta["prefill"]["kind"] == meta["decode"]["kind"] == "analytical"
    assert meta["model"]["modelled"]["name"] == "llama3_8b" and meta["model"]["run"]["name"] == "tiny"
    assert meta["model"]["modelled"]["shape"]["hidden_size"] == 4096


def test_per_role_specs_apply_to_disagg_only():
    cfg = make_config(f"hardware.emulate_prefill={TINY_PROFILE}", f"hardware.emulate_decode={TINY_PROFILE}")
    emulation = Emulation.from_hardware(cfg.hardware)
    assert emulation.spec_for("prefill_only") == emulation.spec_for("decode_only") == str(TINY_PROFILE)
    with pytest.raises(ConfigError, match="mode=disagg only"):
        emulation.spec_for("chunked")


def plans(n: int, device: str = "cpu") -> list:
    return [launcher.WorkerPlan(rank, "chunked", device) for rank in range(n)]


def test_more_workers_than_cores_says_so_in_one_line_once(monkeypatch, caplog):
    monkeypatch.setattr(launcher, "available_cores", lambda: [0, 1])
    monkeypatch.setattr(notices, "_said", set())  # as in a fresh process
    with caplog.at_level(logging.WARNING, logger=launcher.__name__):
        shared = launcher.plan_cores(plans(4), paced=False)
        again = launcher.plan_cores(plans(4), paced=False)  # the next point of a sweep
    assert shared.pins == again.pins == (None,) * 4 and shared.cores_per_worker == 0.5
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "4 CPU workers share 2 cores" in lines[0] and "interference" in lines[0]
    assert "hardware.emulate" in lines[0]


def test_enough_cores_pin_each_worker_to_its_own(monkeypatch, caplog):
    monkeypatch.setattr(launcher, "available_cores", lambda: [2, 5, 7])
    with caplog.at_level(logging.WARNING, logger=launcher.__name__):
        plan = launcher.plan_cores(plans(2), paced=False)
        assert launcher.plan_cores(plans(2, "cuda:0"), paced=False) is None
    assert plan.pins == (2, 5) and plan.cores_per_worker == 1.5 and not caplog.records


def write_profile(path, **terms) -> str:
    tiny = dataclasses.asdict(PRESETS["tiny"])
    path.write_text(json.dumps({"model": tiny, "dtype": "float32", "cost_model": {**ZERO, **terms}}))
    return str(path)


@pytest.mark.slow
def test_emulated_disagg_run_is_paced_and_keeps_its_tokens(tmp_path):
    p_profile = write_profile(
        tmp_path / "p.json",
        overhead_s=0.02,
        per_prefill_token_s=5e-5,
        transfer_latency_s=0.03,
        transfer_bytes_per_s=2e7,
    )
    d_profile = write_profile(tmp_path / "d.json", overhead_s=0.01, per_decode_seq_s=1e-3)
    cfg = make_config(
        *small_workload(8, rate=20.0),
        "mode=disagg",
        f"hardware.emulate={p_profile}",
        f"hardware.emulate_decode={d_profile}",
    )
    workload = build_workload(cfg.workload, seed=cfg.seed, vocab_size=512, max_model_len=256)
    expected = LLM("tiny", max_model_len=256, num_kv_blocks=256).generate(
        [list(r.prompt_token_ids) for r in workload.requests], [r.output_len for r in workload.requests]
    )
    affinity = {}

    def pinned(cluster):
        if hasattr(os, "sched_getaffinity"):
            affinity.update({rank: os.sched_getaffinity(msg.pid) for rank, msg in cluster.started.items()})

    out = tmp_path / "run"
    result = serve(cfg, out, on_started=pinned, progress=False)
    requests = result["requests"].set_index("request_id")
    assert (requests.status == "ok").all(), requests.reason.unique()
    for r, tokens in zip(workload.requests, expected):
        assert list(requests.loc[r.request_id, "output_token_ids"]) == tokens

    steps = result["steps"]
    p, d = (CostModel.from_profile(json.loads(open(f).read())) for f in (p_profile, d_profile))
    for _, step in steps.iterrows():
        model = p if step.role == "prefill_only" else d
        chunks = [tuple(c) for c in step.prefill_chunks]
        modelled = model.step_time(
            step.prefill_tokens, model.prefill_context(chunks) if chunks else 0.0, step.decode_seqs, step.decode_context
        )
        assert step.modelled_s == pytest.approx(modelled)
    # each worker's step ends its modelled time after the previous step's end at the earliest (the
    # host's work between steps counts in its pace); a step marked overrun ran past that, and an
    # unmarked one ended within half a step of it
    real = steps[["schedule_s", "prepare_s", "forward_s", "sample_s", "postprocess_s"]].sum(axis=1)
    assert (real <= steps.end_s - steps.start_s + 1e-6).all()
    for _, own in steps.sort_values("start_s").groupby("worker"):
        since = np.concatenate([[own.start_s.iloc[0]], own.end_s.to_numpy()[:-1]])
        assert (own.end_s - since >= own.modelled_s - 1e-6).all()
        assert (~own.pace_overrun | (own.end_s - since > own.modelled_s)).all()
        assert (own.pace_overrun | (own.end_s - own.start_s <= 1.5 * own.modelled_s + 1e-6)).all()

    transfers = result["transfers"]
    assert len(transfers) == sum(1 for t in expected if len(t) > 1)
    assert ((transfers.end_s - transfers.start_s) >= p.transfer_time(transfers.kv_bytes) - 1e-6).all()

    saved = read_results(out)
    emulated = saved["meta"]["emulated"]
    assert emulated == saved["summary"]["emulated"]
    assert (emulated["prefill"]["kind"], emulated["prefill"]["name"]) == ("measured", p_profile)
    assert (emulated["decode"]["kind"], emulated["decode"]["name"]) == ("measured", d_profile)
    assert saved["summary"]["pacing"]["steps"] == len(steps)
    assert saved["meta"]["cores_per_worker"] == pytest.approx(len(launcher.available_cores()) / 2, abs=1e-3)
    if len(launcher.available_cores()) >= 2 and affinity:
        assert sorted(len(cores) for cores in affinity.values()) == [1, 1]
        assert affinity[0] != affinity[1]
