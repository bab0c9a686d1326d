"""vLLM's /metrics as the testbed reads it: the text format parsed with bounds (generated input never
raises), and a point's figures from the scrapes around it."""

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from testbed.deploy import prometheus

SCRAPE = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="model"} 3.0
vllm:request_queue_time_seconds_sum{engine="0",model_name="model"} 1.5
vllm:request_queue_time_seconds_count{engine="0",model_name="model"} 3.0
vllm:num_preemptions_total{engine="0",model_name="model"} 2.0
weird{a="x\\"y,}",b="z"} 7 1700000000
no_labels 4e3
not a sample line
bad_value{a="1"} NaNx
"""


def test_samples_labels_and_escapes_are_read():
    scrape = prometheus.parse(SCRAPE)
    assert scrape.total("vllm:num_requests_running") == 3.0
    assert scrape.total("weird", a='x"y,}') == 7.0  # an escaped quote and a brace inside a label value
    assert scrape.total("no_labels") == 4000.0
    assert scrape.refused == 2  # the two lines that are no samples are counted, not raised


def test_point_figures_are_differences_and_gauges_over_the_point():
    before = prometheus.parse(SCRAPE)
    after = prometheus.parse(
        SCRAPE.replace('_sum{engine="0",model_name="model"} 1.5', '_sum{engine="0",model_name="model"} 3.5')
        .replace('_count{engine="0",model_name="model"} 3.0', '_count{engine="0",model_name="model"} 7.0')
        .replace(
            'num_preemptions_total{engine="0",model_name="model"} 2.0',
            'num_preemptions_total{engine="0",model_name="model"} 5.0',
        )
    )
    running = [prometheus.parse('vllm:num_requests_running{engine="0"} %d' % n) for n in (1, 5)]
    figures = prometheus.point_figures(before, after, running)
    assert figures["queue_s"] == {"count": 4.0, "mean": 0.5}
    assert figures["preemptions"] == 3.0
    assert figures["running"] == {"mean": 3.0, "max": 5.0}
    assert "kv_transfer_s" not in figures  # not exported by this instance: left out, not reported as 0


printable = st.text(st.characters(blacklist_categories=("Cs",)), max_size=200)


@settings(max_examples=300, deadline=None)
@given(st.lists(printable, max_size=20))
def test_generated_bodies_never_raise(lines):
    body = "\n".join(lines)
    scrape = prometheus.parse(body)
    assert scrape.refused <= len(body.split("\n"))
    assert all(isinstance(v, float) for v in scrape.samples.values())


@settings(max_examples=200, deadline=None)
@given(
    st.from_regex(r"[a-zA-Z_:][a-zA-Z0-9_:]{0,20}", fullmatch=True),
    st.dictionaries(st.from_regex(r"[a-zA-Z_][a-zA-Z0-9_]{0,10}", fullmatch=True), printable, max_size=4),
    st.floats(allow_nan=False),
)
def test_written_samples_read_back(name, labels, value):
    escaped = {k: v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") for k, v in labels.items()}
    body = ",".join(f'{k}="{v}"' for k, v in escaped.items())
    line = f"{name}{{{body}}} {value!r}" if labels else f"{name} {value!r}"
    scrape = prometheus.parse(line)
    assert scrape.refused == 0
    assert math.isclose(scrape.total(name, **labels), value) or (math.isinf(value) and scrape.total(name) == value)
