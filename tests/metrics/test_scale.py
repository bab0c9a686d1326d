"""The fast paths that large runs take (column-wise tables, one-pass token arrays, one draw of
prompt tokens) give exactly what the straightforward per-row code gives."""

import math
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

from testbed.metrics import Event, RequestLog, SLOConfig, meets_slo, pooled_itl, request_table
from testbed.metrics.latency import add_derived, as_times, harness_delays
from testbed.metrics.record import StepRecord
from testbed.metrics.results_dir import write_parquet
from testbed.metrics.steps import RECORD_FIELDS, StepLog, steps_table
from testbed.workload.builder import _Prompts, _synthetic_shape
from testbed.workload.config import LengthConfig, WorkloadConfig
from testbed.workload.request import TokenTable, derived_rng

CELLS = [[0.1, 0.3, 0.35], [], None, float("nan"), np.array([1.0, 1.5]), [2.0], (3.0, 3.25, 4.0), np.array([])]
WORKER_CELLS = [[0.05, 0.2, 0.3], [], [0.7], float("nan"), [0.9, 1.4], [], (2.9, 3.0, 3.9), [5.0]]


def test_integers_drawn_at_once_are_the_draws_one_by_one():
    """What _Prompts._synthetic relies on: numpy's Generator.integers continues one stream."""
    sizes = [0, 3, 1, 250, 7, 0, 64]
    one_by_one = derived_rng(0, 3)
    parts = [one_by_one.integers(0, 32000, size=n, dtype=np.int64) for n in sizes]
    at_once = derived_rng(0, 3).integers(0, 32000, size=sum(sizes), dtype=np.int64)
    assert np.array_equal(np.concatenate(parts), at_once)


@pytest.mark.parametrize("system_prompt_len", [0, 120])
def test_synthetic_prompts_match_building_them_one_by_one(system_prompt_len):
    cfg = WorkloadConfig(
        num_requests=200,
        rate=10.0,
        system_prompt_len=system_prompt_len,
        input_len=LengthConfig(dist="uniform", min=1, max=300),
    )
    shape, _ = _synthetic_shape(cfg, 5)
    order = np.argsort(shape.arrival_s, kind="stable")
    lengths = shape.input_len.copy()
    lengths[:20] = np.arange(20)  # shorter than the system prompt, and empty
    tokens = TokenTable(1000)
    fast = _Prompts(cfg, 5, 1000, tokens).build_all(shape, order, lengths)
    slow_prompts = _Prompts(cfg, 5, 1000, tokens)
    assert fast == [slow_prompts.build(shape, int(row), int(lengths[row])) for row in order]


def _step(start, role="prefill_only", **fields):
    values = dict(
        start=start,
        end=start + 0.5,
        role=role,
        prefill_tokens=3,
        decode_seqs=0,
        batched_tokens=3,
        kv_blocks_used=2,
        num_waiting=1,
        num_running=0,
        schedule_s=0.0,
        prepare_s=0.0,
        forward_s=0.5,
        sample_s=0.0,
        postprocess_s=0.0,
        prefill_chunks=((3, 0),),
    )
    return StepRecord(**{**values, **fields})


def _steps_by_rows(steps, t0):
    """steps_table the straightforward way: a row per step, pandas infers each column."""
    counts, rows = {}, []
    for worker, record in steps:
        counts[worker] = counts.get(worker, -1) + 1
        rows.append((worker, counts[worker], *(getattr(record, f) for f in RECORD_FIELDS)))
    frame = pd.DataFrame.from_records(rows, columns=["worker", "step", *RECORD_FIELDS])
    frame = frame.rename(columns={"start": "start_s", "end": "end_s"})
    frame["start_s"] -= t0
    frame["end_s"] -= t0
    used, total = pd.to_numeric(frame["kv_blocks_used"]), frame["kv_blocks_total"].astype(float)
    frame["kv_occupancy"] = (used / total).where(total > 0)  # the derived columns, row by row
    covered = frame["prefix_hit_tokens"] + frame["prefill_tokens"]
    frame["prefix_hit_rate"] = (frame["prefix_hit_tokens"] / covered).where(covered > 0)
    return frame


@pytest.mark.parametrize("odd", [{}, {"kv_blocks_used": None}, {"decode_context": 2.5}])
def test_steps_table_matches_a_row_per_step(odd):
    steps = [
        (0, _step(10.0)),
        (3, _step(10.2, "decode_only", decode_seqs=4, prefill_chunks=())),
        (0, _step(10.6, pace_overrun=True, modelled_s=0.4)),
        (3, _step(11.0, "decode_only", **odd)),
    ]
    table = steps_table(steps, 10.0)
    expected = _steps_by_rows(steps, 10.0)
    pd.testing.assert_frame_equal(table, expected[list(table.columns)], check_exact=True)
    assert table["step"].tolist() == [0, 0, 1, 1]
    assert steps_table([], 0.0).columns.tolist() == table.columns.tolist()


RUN_FIELDS = ("start", "end", "kv_blocks_used", "forward_s", "decode_context")


def _run(start: float, count: int, **odd) -> dict:
    """add_many's fields of a decode run: per-row lists for what changes, one value for the rest."""
    starts = [start + 0.1 * i for i in range(count)]
    fields = dict(
        start=starts,
        end=[t + 0.05 for t in starts],
        role="decode_only",
        prefill_tokens=0,
        decode_seqs=2,
        batched_tokens=2,
        kv_blocks_used=[4 + i // 2 for i in range(count)],
        num_waiting=0,
        num_running=2,
        schedule_s=0.0,
        prepare_s=0.0,
        forward_s=[0.05] * count,
        sample_s=0.0,
        postprocess_s=0.0,
        prefill_chunks=(),
        decode_context=list(range(30, 30 + 2 * count, 2)),
    )
    return {**fields, **odd}


def _expand(fields: dict, count: int) -> list[StepRecord]:
    return [StepRecord(**{k: (v[i] if isinstance(v, list) else v) for k, v in fields.items()}) for i in range(count)]


@pytest.mark.parametrize("odd", [{}, {"num_waiting": None}, {"role": "decode_only*"}, {"decode_context": 2.5}])
def test_runs_of_rows_land_where_rows_added_one_by_one_would(odd):
    """StepLog.add_many keeps a run apart (its rows follow the single rows in the table): each
    row, its step number and every column's type equal those of the same rows added one at a
    time."""
    log, pairs = StepLog(), []
    plan = [
        ("row", 0, 10.0),
        ("run", 3, 10.1, 4, {}),
        ("row", 3, 10.6),
        ("run", 0, 10.7, 2, odd),
        ("run", 3, 10.8, 3, {}),
        ("row", 0, 11.0),
        ("row", 5, 11.1),
        ("run", 5, 11.2, 1, {}),
    ]
    for kind, worker, start, *rest in plan:
        if kind == "row":
            record = _step(start)
            log.add(worker, record)
            pairs.append((worker, record))
        else:
            count, extra = rest
            fields = _run(start, count, **extra)
            log.add_many(worker, count, **fields)
            pairs.extend((worker, record) for record in _expand(fields, count))

    def by_step(frame):
        return frame.sort_values(["worker", "step"], kind="stable").reset_index(drop=True)

    table = steps_table(log, 10.0)
    assert table["worker"].tolist()[:4] == [0, 3, 0, 5]  # the single rows first, as they came
    pd.testing.assert_frame_equal(by_step(table), by_step(steps_table(pairs, 10.0)), check_exact=True)
    pd.testing.assert_frame_equal(
        by_step(table), by_step(_steps_by_rows(pairs, 10.0)[list(table.columns)]), check_exact=True
    )


def _table_by_rows(log: RequestLog) -> pd.DataFrame:
    """RequestLog.table the straightforward way: a dict per request."""
    rows = []
    for _, r in sorted(log._records.items()):
        rows.append(
            {
                "request_id": r.request_id,
                "arrival_s": r.arrival_s,
                "input_len": r.input_len,
                "output_len": r.output_len,
                "session_id": r.session_id,
                "turn": r.turn,
                "tenant": r.tenant,
                "prefill_worker": r.prefill_worker,
                "decode_worker": r.decode_worker,
                "status": r.status or "failed",
                "reason": r.reason if r.status else "unfinished",
                "refused_by": r.refused_by if r.status == "rejected" else "",
                "kv_bytes": r.kv_bytes,
                "num_prefill_chunks": r.num_prefill_chunks,
                "token_times": list(r.token_times),
                "token_worker_times": list(r.token_worker_times),
                "output_token_ids": list(r.output_token_ids),
                **{c: v for c, v in r.times.items()},
            }
        )
    return request_table(rows)


def test_request_log_table_matches_a_dict_per_request():
    log = RequestLog(100.0)
    for rid in range(4):
        log.register(
            SimpleNamespace(
                request_id=rid,
                arrival_s=float(rid),
                input_len=10 * rid + 1,
                output_len=3,
                session_id=rid if rid % 2 else None,
                turn=rid % 2,
                tenant=f"t{rid % 2}",
            )
        )
    log.event(0, Event.PREFILL_START, 100.5, worker=1)
    log.event(0, Event.KV_TRANSFER_END, 100.9, kv_bytes=64, decode_worker=2)
    log.tokens(0, [5, 6], 101.0, 101.1)
    log.finish(0, 101.1)
    log.tokens(1, [7], [101.2], 101.3)  # never finishes: unfinished
    log.fail(2, 102.0, "worker died")
    log.reject(SimpleNamespace(request_id=3, arrival_s=3.0, input_len=9, output_len=3), 103.0, "full")
    pd.testing.assert_frame_equal(log.table(), _table_by_rows(log), check_exact=True)


def test_an_empty_requests_table_keeps_list_columns_and_writes(tmp_path):
    table = RequestLog(0.0).table()
    assert all(table[c].dtype == object for c in ("token_times", "token_worker_times", "output_token_ids"))
    write_parquet(tmp_path / "requests.parquet", table)
    assert pd.read_parquet(tmp_path / "requests.parquet").columns.tolist() == table.columns.tolist()


def test_token_arrays_match_per_cell_arrays():
    table = add_derived(
        request_table(
            [
                {"request_id": i, "arrival_s": 0.0, "token_times": c, "token_worker_times": w}
                for i, (c, w) in enumerate(zip(CELLS, WORKER_CELLS))
            ]
        )
    )
    per_cell = [as_times(c) for c in table["token_times"]]
    assert np.array_equal(pooled_itl(table), np.concatenate([np.diff(t) for t in per_cell]))
    delays = [
        as_times(c) - as_times(w)
        for c, w in zip(table["token_times"], table["token_worker_times"])
        if as_times(c).size and as_times(c).size == as_times(w).size
    ]
    assert np.array_equal(harness_delays(table), np.concatenate(delays))
    first = [t[0] if t.size else math.nan for t in per_cell]
    assert np.array_equal(table["ttft"].to_numpy(), np.array(first), equal_nan=True)
    assert table["num_tokens"].tolist() == [t.size for t in per_cell]


def test_meets_slo_per_tenant_matches_a_lookup_per_request():
    table = pd.DataFrame(
        {
            "tenant": ["a", "b", "c", "a", "b"],
            "ttft": [0.5, 1.5, 0.9, 2.5, 0.1],
            "tpot": [0.05, 0.05, 0.3, 0.01, 0.2],
            "num_tokens": [3, 3, 3, 1, 3],
            "status": ["ok", "ok", "ok", "ok", "failed"],
        }
    )
    slo, tenants = SLOConfig(1.0, 0.1), {"b": SLOConfig(2.0, 0.5), "c": SLOConfig(0.8, 0.4)}
    rows = list(table[["tenant", "ttft", "tpot", "num_tokens", "status"]].itertuples(index=False))
    for scale in (1.0, 3.0):
        expected = [
            s == "ok"
            and t <= tenants.get(n, slo).ttft_s * scale
            and (k <= 1 or p <= tenants.get(n, slo).tpot_s * scale)
            for n, t, p, k, s in rows
        ]
        assert meets_slo(table, slo, tenants, scale).tolist() == expected
