"""A measured profile another tool wrote, or a damaged one, is one line naming the file and the key
that gave it, never a traceback from deep in the cost model; a property test feeds it arbitrary
JSON and bytes."""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from testbed.errors import ConfigError
from testbed.sim.config import SHIPPED
from testbed.sim.devices import resolve_roles
from tests.cluster_helpers import make_config, sim_args
from tests.fuzzing import fuzz_selected, long, quick  # noqa: F401 - fuzz_selected is a fixture

GOOD = json.loads((SHIPPED / "tiny_cpu.json").read_text())


def resolve(path: Path):
    return resolve_roles(*sim_args(make_config("executor=sim", "model=tiny", f"sim.profile={path}")), {"mixed"})


@pytest.mark.parametrize(
    "content",
    [
        b"\xff\xfe not text",
        b"[" * 100_000,
        b"[1, 2]",
        b'{"model": 3}',
        json.dumps({**GOOD, "cost_model": {"step": "x"}}).encode(),
        json.dumps({k: v for k, v in GOOD.items() if k != "dtype_bytes"}).encode(),
    ],
)
def test_a_damaged_profile_is_one_line_naming_the_file(tmp_path, content):
    path = tmp_path / "profile.json"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as refused:
        resolve(path)
    assert str(path) in str(refused.value) and "sim.profile" in str(refused.value) and "\n" not in str(refused.value)


CONFIG = make_config("executor=sim", "model=tiny")
SCALAR = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6)
JSON = st.recursive(
    SCALAR,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=12,
)
# the shipped profile with one of its sections (or one entry of a section) replaced by anything
DAMAGED = st.tuples(st.sampled_from(sorted(GOOD)), st.text(max_size=6), JSON).map(
    lambda t: {**GOOD, t[0]: {**GOOD[t[0]], t[1]: t[2]} if isinstance(GOOD[t[0]], dict) and t[1] else t[2]}
)


def one_profile(content: bytes):
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "profile.json"
        path.write_bytes(content)
        try:
            resolve_roles(
                *sim_args(dataclasses.replace(CONFIG, sim=dataclasses.replace(CONFIG.sim, profile=str(path)))),
                {"mixed"},
            )
        except ConfigError as refused:
            assert "\n" not in str(refused) and "sim.profile" in str(refused)


PROFILES = st.binary(max_size=200) | DAMAGED.map(lambda d: json.dumps(d).encode())
test_any_profile_file_is_taken_or_refused_in_one_line = quick(given(PROFILES)(one_profile), 30)
test_any_profile_file_is_taken_or_refused_in_one_line_fuzz = long(given(PROFILES)(one_profile))
