"""Property tests of the other decoders of outside input: the HTTP request parser, the trace
readers and the configuration's validation. Whatever comes in, each answers with its own error
type in one line (a 4xx for a request, a line naming the file for a trace, a line naming the key
for a configuration), never with another exception."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from testbed import errors
from testbed.http.protocol import FIELDS, BadRequest, parse_completion
from testbed.workload.config import WorkloadError
from testbed.workload.traces import read_trace
from tests.fuzzing import FUZZ, QUICK, fuzz_selected, long, quick  # noqa: F401 - fuzz_selected is a fixture

SCALAR = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(-3, 300)
    | st.floats()
    | st.text(max_size=12)
    | st.sampled_from(["", "1", "x", "-1", "1e309", "2023-11-16 18:15:46.6805900"])
)
JSON = st.recursive(
    SCALAR,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=24,
)


# -- the HTTP request parser ------------------------------------------------------------------------
def one_request(body: bytes):
    try:
        parse_completion(body, vocab_size=100, max_model_len=64, model="testbed", encode=lambda text: [1] * len(text))
    except BadRequest as refused:
        assert 400 <= refused.status < 500 and "\n" not in str(refused)


REQUESTS = st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=6), JSON, max_size=6).map(
    lambda d: json.dumps(d).encode()
)
BODIES = st.binary(max_size=300) | REQUESTS | st.builds(lambda d, cut: d[:cut], REQUESTS, st.integers(0, 200))

test_any_request_body_is_parsed_or_refused_with_a_4xx = quick(given(BODIES)(one_request))
test_any_request_body_is_parsed_or_refused_with_a_4xx_fuzz = long(given(BODIES)(one_request))


# -- the trace readers --------------------------------------------------------------------------------
def one_trace(trace: tuple[bytes, str]):
    content, suffix = trace
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"trace{suffix}"
        path.write_bytes(content)
        try:
            read_trace(path)
        except WorkloadError as refused:
            assert str(path) in str(refused) and "\n" not in str(refused), str(refused)


ROW = st.dictionaries(
    st.sampled_from(
        [
            "timestamp",
            "input_length",
            "output_length",
            "hash_ids",
            "arrival_s",
            "input_len",
            "output_len",
            "prompt_token_ids",
            "tenant",
        ]
    ),
    JSON,
    max_size=6,
)
JSONL = st.lists(ROW, min_size=1, max_size=4).map(lambda rows: "\n".join(json.dumps(r) for r in rows).encode())
CSV_FIELD = st.sampled_from(
    ["", "7", "-1", "1.5", "2023-11-16 18:15:46.68", "2023-11-16T18:15:46+01:00", '"a,b"', "x" * 300]
) | st.text(max_size=10)
CSV = st.lists(st.lists(CSV_FIELD, min_size=1, max_size=4), max_size=4).map(
    lambda rows: ("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(",".join(r) for r in rows)).encode()
)
TRACES = st.tuples(st.binary(max_size=300) | JSONL, st.just(".jsonl")) | st.tuples(
    st.binary(max_size=300) | CSV, st.just(".csv")
)

test_any_trace_file_is_read_or_refused_naming_it = quick(given(TRACES)(one_trace))
test_any_trace_file_is_read_or_refused_naming_it_fuzz = long(given(TRACES)(one_trace))


# -- the configuration ---------------------------------------------------------------------------------
KEYS = [
    "workload.rate",
    "workload.num_requests",
    "scheduler.max_batched_tokens",
    "scheduler.chunk_size",
    "engine.block_size",
    "model.max_model_len",
    "cluster.num_prefill",
    "cluster.num_decode",
    "slo.ttft_s",
    "kv_transfer.granularity",
    "kv_transfer.decode_binding",
    "engine.num_kv_blocks",
    "http.max_streams",
    "cluster.heartbeat_s",
    "workload.burstiness",
    "seed",
    "hardware.num_devices",
    "engine.attention_backend",
]
GROUPS = ["mode", "model", "workload"]  # config groups: a name (a number here is the xfail below)
# a name Hydra reads as a string (a number, inf, nan, true or null given for a group: the xfail below)
NAME = st.from_regex(r"[a-z][a-z0-9._-]{0,7}", fullmatch=True).filter(
    lambda v: v.lower() not in ("inf", "nan", "true", "false", "null")
)
VALUE = (
    st.integers(-5, 10**6).map(str)
    | st.floats().map(repr)
    | st.sampled_from(["null", "true", "[1,2]", "{}", "nan", "inf", "-0", "''"])
    | NAME
)
OVERRIDES = (
    st.tuples(
        st.dictionaries(st.sampled_from(KEYS), VALUE, max_size=3),
        st.dictionaries(st.sampled_from(GROUPS), NAME, max_size=1),
    )
    .filter(lambda t: t[0] or t[1])
    .map(lambda t: [f"{k}={v}" for k, v in {**t[0], **t[1]}.items()])
)


def one_config(overrides: list[str]):
    from testbed.config import check_overrides
    from tests.cluster_helpers import make_config

    problem = check_overrides(["hardware=cpu", *overrides])
    if problem is not None:
        assert "\n" not in problem
        return
    try:
        make_config("hardware=cpu", *overrides)
    except errors.TestbedError as refused:
        assert "\n" not in str(refused), str(refused)


test_any_override_is_taken_or_refused_in_one_line = quick(given(OVERRIDES)(one_config), max(QUICK // 4, 5))
test_any_override_is_taken_or_refused_in_one_line_fuzz = long(given(OVERRIDES)(one_config), max(FUZZ // 10, 5))


def test_a_number_for_a_config_group_is_one_line():
    """Found by the property above: Hydra's ValueError for `mode=0` got past check_overrides."""
    from testbed.config import check_overrides

    problem = check_overrides(["mode=0"])
    assert problem and "\n" not in problem and "mode=0" in problem
