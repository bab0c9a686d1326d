"""The in-run interference measure on hand-made timelines: which background gaps an injected
prefill overlapped, on the same worker or, for a decode-only worker, anywhere."""

import numpy as np
import pandas as pd
import pytest

from testbed.metrics.events import request_table
from testbed.metrics.interference import background_gaps, decode_steps


def background(rid, worker, times, decode_worker=None):
    return {
        "request_id": rid,
        "tenant": "background",
        "prefill_worker": worker,
        "decode_worker": decode_worker,
        "token_times": list(times),
        "token_worker_times": list(times),
        "output_token_ids": [1] * len(times),
        "arrival_s": 0.0,
        "status": "ok",
    }


def injected(rid, worker, start, end):
    return {
        "request_id": rid,
        "tenant": "default",
        "prefill_worker": worker,
        "prefill_start_s": start,
        "prefill_end_s": end,
        "token_times": [end],
        "token_worker_times": [end],
        "output_token_ids": [1],
        "arrival_s": start,
        "status": "ok",
    }


def steps_table(rows):
    return pd.DataFrame(rows, columns=["worker", "role", "start_s", "end_s", "prefill_tokens", "decode_seqs"])


def test_colocated_gap_overlapping_a_prefill_on_its_worker_is_exposed():
    # worker 0 decodes every 10 ms, then a 100 ms prefill (1.00-1.10) pauses it; worker 1 is untouched
    times0 = [0.95, 0.96, 0.97, 0.98, 0.99, 1.00, 1.11, 1.12, 1.13]
    times1 = [0.95 + 0.01 * i for i in range(9)]
    table = request_table([background(0, 0, times0), background(1, 1, times1), injected(2, 0, 1.0, 1.1)])
    steps = steps_table(
        [(0, "colocated", 1.0, 1.1, 512, 0), (0, "colocated", 0.99, 1.0, 0, 1), (1, "colocated", 0.99, 1.0, 0, 1)]
    )
    gaps = background_gaps(table, steps)
    exposed = gaps[gaps.exposed]
    assert len(exposed) == 1 and exposed.itl.iloc[0] == pytest.approx(0.11) and exposed.worker.iloc[0] == 0
    assert (gaps[gaps.worker == 1].exposed == False).all()  # noqa: E712 - a prefill elsewhere is not its
    assert len(gaps) == 16
    view = decode_steps(table, steps)
    assert view.with_prefill.sum() == 0 and len(view) == 2  # decode steps carry no prefill here


def test_decode_only_worker_is_exposed_to_prefills_anywhere_and_startup_is_left_out():
    # the background starts at 0.5 (its own prefill before that is not interference)
    times = [0.5, 0.6, 0.7, 0.8, 0.9]
    table = request_table(
        [background(0, 0, times, decode_worker=1), injected(1, 0, 0.62, 0.66), injected(2, 0, 0.1, 0.2)]
    )
    steps = steps_table(
        [
            (0, "prefill_only", 0.62, 0.66, 256, 0),
            (1, "decode_only", 0.6, 0.7, 0, 1),
            (1, "decode_only", 0.7, 0.8, 0, 1),
        ]
    )
    gaps = background_gaps(table, steps)
    assert list(gaps.exposed) == [False, True, False, False]  # (0.6, 0.7] holds the 0.62-0.66 prefill
    view = decode_steps(table, steps)
    assert list(view.with_prefill) == [True, False]
    assert np.allclose(view.seconds, [0.1, 0.1])


def test_no_background_gives_an_empty_table():
    table = request_table([injected(0, 0, 0.0, 0.1)])
    assert background_gaps(table, steps_table([])).empty
