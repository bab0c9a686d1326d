"""Trace readers on the shared production traces and on small hand-written files."""

import json
from pathlib import Path

import numpy as np
import pytest

from testbed.workload import WorkloadConfig, WorkloadError, build_workload
from testbed.workload.traces import read_trace, select
from tests.paths import ROOT

TINY = dict(vocab_size=512, max_model_len=2048)


@pytest.fixture(scope="module")
def traces() -> Path:
    folder = ROOT / "traces"
    if not folder.is_dir():
        pytest.skip(f"full traces not found at {folder}")
    return folder


# Rows and mean input/output lengths of the full traces (their README rounds to the token).
@pytest.mark.parametrize(
    "name,rows,mean_in,mean_out",
    [
        ("azure_conv_2023.csv", 19_366, 1_155, 211),
        ("azure_code_2023.csv", 8_819, 2_048, 28),
        ("mooncake_conversation.jsonl", 12_031, 12_035, 343),
    ],
)
def test_shared_trace_matches_readme(traces, name, rows, mean_in, mean_out):
    records = read_trace(traces / name)
    assert len(records) == rows
    assert abs(records.input_len.mean() - mean_in) <= 0.5
    assert abs(records.output_len.mean() - mean_out) <= 0.5
    assert records.timestamps_s[0] == 0.0 and np.all(np.diff(records.timestamps_s) >= 0)
    assert 3400 < records.timestamps_s[-1] < 3700  # "about one hour"


def test_azure_timestamps_keep_seven_fractional_digits(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:50.9951690,396,109\n"
        "2023-11-16 18:16:00.0000001,10,1\n"
    )
    records = read_trace(path)
    # 50.9951690 - 46.6805900 = 4.3145790; 60.0000001 - 46.6805900 = 13.3194101
    assert np.allclose(records.timestamps_s, [0.0, 4.3145790, 13.3194101], atol=1e-9)
    assert list(records.input_len) == [374, 396, 10] and list(records.output_len) == [44, 109, 1]


def test_malformed_csv_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,374,44\n"
        "2023-11-16 18:15:47.0000000,abc,44\n"
    )
    with pytest.raises(WorkloadError, match=r"bad\.csv line 3: ContextTokens") as info:
        read_trace(path)
    assert "\n" not in str(info.value)


def test_csv_missing_column_is_reported(tmp_path):
    path = tmp_path / "cols.csv"
    path.write_text("TIMESTAMP,ContextTokens\n2023-11-16 18:15:46.6805900,374\n")
    with pytest.raises(WorkloadError, match=r"cols\.csv line 1: missing column GeneratedTokens"):
        read_trace(path)


def test_malformed_jsonl_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(
        '{"timestamp": 0, "input_length": 10, "output_length": 2, "hash_ids": [0]}\n'
        '{"timestamp": 5, "input_length": 10\n'
    )
    with pytest.raises(WorkloadError, match=r"bad\.jsonl line 2: not valid JSON"):
        read_trace(path)
    path.write_text(
        '{"timestamp": 0, "input_length": 10, "output_length": 2}\n'
        '{"timestamp": 5, "input_length": -1, "output_length": 2}\n'
    )
    with pytest.raises(WorkloadError, match=r"line 2: input_length must be an integer >= 0"):
        read_trace(path)
    path.write_text('{"timestamp": 0, "output_length": 2}\n')
    with pytest.raises(WorkloadError, match=r"line 1: missing field 'input_length'"):
        read_trace(path)


def test_window_count_and_speedup(tmp_path):
    path = tmp_path / "t.jsonl"
    rows = [{"timestamp": 1000 * i, "input_length": 100 + i, "output_length": 5} for i in range(10)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    chosen = select(read_trace(path), start_s=2.0, window_s=5.0, num_requests=3)
    assert list(chosen.input_len) == [102, 103, 104] and np.allclose(chosen.timestamps_s, [0, 1, 2])
    cfg = WorkloadConfig(
        arrival="trace", path=str(path), start_s=2.0, window_s=5.0, num_requests=0, speedup=2.0, length_scale=0.5
    )
    w = build_workload(cfg, seed=0, **TINY)
    assert [r.arrival_s for r in w.requests] == pytest.approx([0, 0.5, 1.0, 1.5, 2.0])
    assert [r.input_len for r in w.requests] == [51, 52, 52, 52, 53]  # 102..106 * 0.5 rounded half to even
    assert all(r.output_len == 2 for r in w.requests)  # round(2.5) = 2


def test_mooncake_hash_ids_share_block_tokens(tmp_path):
    path = tmp_path / "m.jsonl"
    rows = [
        {"timestamp": 0, "input_length": 1500, "output_length": 4, "hash_ids": [7, 8, 9]},
        {"timestamp": 10, "input_length": 1200, "output_length": 4, "hash_ids": [7, 8, 11]},
        {"timestamp": 20, "input_length": 300, "output_length": 4, "hash_ids": [12]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = WorkloadConfig(arrival="trace", path=str(path), num_requests=0)
    a, b, c = build_workload(cfg, seed=3, **TINY).requests
    assert a.prompt_token_ids[:1024] == b.prompt_token_ids[:1024]  # blocks 7 and 8
    assert a.prompt_token_ids[1024:1200] != b.prompt_token_ids[1024:1200]  # blocks 9 and 11
    assert a.prefix_block_ids == (7, 8, 9) and c.prefix_block_ids == (12,)
    assert a.prompt_token_ids[:300] != c.prompt_token_ids
    # Scaled: blocks of 512 * 0.25 = 128 tokens, still shared.
    scaled = WorkloadConfig(arrival="trace", path=str(path), num_requests=0, length_scale=0.25)
    a4, b4, _ = build_workload(scaled, seed=3, **TINY).requests
    assert a4.input_len == 375 and a4.prompt_token_ids[:256] == b4.prompt_token_ids[:256]
    assert a4.prompt_token_ids[256:300] != b4.prompt_token_ids[256:300]
    # Same seed, same block tokens; another seed, other tokens.
    assert build_workload(cfg, seed=3, **TINY).requests[0] == a
    assert build_workload(cfg, seed=4, **TINY).requests[0].prompt_token_ids != a.prompt_token_ids


def test_trace_lengths_at_synthetic_rate(traces):
    cfg = WorkloadConfig(arrival="poisson", rate=50.0, path="azure_code_2023.csv", num_requests=300, length_scale=0.1)
    w = build_workload(cfg, seed=0, **TINY)
    assert len(w.requests) == 300
    assert abs(300 / w.requests[-1].arrival_s - 50.0) < 10.0
    assert w.report["source"].endswith("azure_code_2023.csv")


def test_native_jsonl_replays_explicit_prompts(tmp_path):
    path = tmp_path / "n.jsonl"
    path.write_text(
        '{"arrival_s": 0.5, "prompt_token_ids": [1, 2, 3], "output_len": 2, "tenant": "x"}\n'
        '{"arrival_s": 0.25, "input_len": 5, "output_len": 1}\n'
    )
    w = build_workload(WorkloadConfig(arrival="trace", path=str(path), num_requests=0), seed=0, **TINY)
    first, second = w.requests
    assert first.arrival_s == 0.0 and first.input_len == 5
    assert second.prompt_token_ids == (1, 2, 3) and second.tenant == "x" and second.arrival_s == 0.25


@pytest.mark.parametrize("name", ["azure_conv_2023.csv", "azure_code_2023.csv", "mooncake_conversation.jsonl"])
def test_bundled_slices_hold_the_first_thousand_requests(name):
    from testbed.workload.traces import read_trace

    bundled = ROOT / "testbed" / "workload" / "traces" / name
    assert len(read_trace(bundled).input_len) == 1000


# -- files that are not traces, and lengths beyond any model -------------------------------------------
def test_lengths_beyond_any_model_are_refused_naming_file_and_line(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text(
        json.dumps({"arrival_s": 0, "input_len": 10, "output_len": 5})
        + "\n"
        + json.dumps({"arrival_s": 1, "input_len": 10, "output_len": 10**8})
        + "\n"
    )
    with pytest.raises(
        WorkloadError,
        match=f"trace {path} line 2: output_len must be an integer >= 0 "
        r"\(at most 10000000; got 100000000\)",
    ):
        read_trace(path)


def test_a_fifo_a_device_or_an_oversized_trace_is_refused_before_reading(tmp_path, monkeypatch):
    """A FIFO hung the reader (and /dev/zero read until memory ran out, where a reader was handed it)."""
    import os

    from testbed.workload import traces

    fifo = tmp_path / "trace.jsonl"
    os.mkfifo(fifo)
    for path in (fifo, Path("/dev/zero")):
        for fmt in (None, "azure_csv", "mooncake_jsonl", "native_jsonl"):
            with pytest.raises(WorkloadError, match=f"trace {path}: not a regular file"):
                read_trace(path, fmt)
    with pytest.raises(WorkloadError, match="workload.path: trace /dev/zero: not a regular file"):
        traces.resolve_trace_path("/dev/zero")
    small = tmp_path / "small.jsonl"
    small.write_text(json.dumps({"arrival_s": 0, "input_len": 10, "output_len": 5}) * 20)
    monkeypatch.setattr(traces, "MAX_FILE_BYTES", 100)
    with pytest.raises(WorkloadError, match="bytes, above the 100-byte cap"):
        read_trace(small)
