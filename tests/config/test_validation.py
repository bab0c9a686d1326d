"""One validation at compose time: every configuration value's type, range and relations, and a
run's expected span and memory against `limits`, refused in one line naming the key (exit 2, no
traceback); a property test over random overrides of every key of the composed config."""

from __future__ import annotations

import copy
import subprocess
import sys
from functools import lru_cache

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf

from testbed import errors
from testbed.config import CONF_DIR, check_overrides, config_problem, register_configs, to_config, to_config_by_merge
from tests.paths import ROOT


@pytest.mark.parametrize(
    "override, message",
    [
        ("seed=-1", "seed=-1 is outside [0, 4294967295]"),
        ("workload.rate=1e-9", "above limits.max_run_s=86400; raise limits.max_run_s"),
        ("workload.num_requests=100000000 workload.rate=1e6", "raise limits.max_memory_gb to run it"),
        ("workload.num_requests=100000000 executor=sim", "raise limits.max_memory_gb to run it"),
        ("engine.num_kv_blocks=100000000", "raise limits.max_memory_gb to run it"),
        ("cluster.heartbeat_s=nan", "cluster.heartbeat_s=nan must be a finite number"),
        ("metrics.stall_factor=inf", "metrics.stall_factor=inf must be a finite number"),
        ("workload.num_requests=99999999999999999999", "workload.num_requests=99999999999999999999 is outside"),
        ("model.dtype=fp8", "model.dtype='fp8' is not one of auto, float32, bfloat16, float16"),
        ("cluster.start_timeout_s=-1", "cluster.start_timeout_s=-1.0 must be > 0"),
        ("faults.kill_worker=-1", "faults.kill_worker=-1 is outside [0, inf]"),
        ("faults.kill_after_ended=3", "faults.kill_after_ended must be >= 1 and needs faults.kill_worker set"),
        ("limits.max_run_s=0", "limits.max_run_s=0.0 must be > 0"),
        ("cluster.cpu_worker_nice=20", "cluster.cpu_worker_nice must be an integer in 0..19 (got 20)"),
    ],
)
def test_a_bad_value_is_refused_at_compose_time_naming_key_and_range(override, message):
    problem = check_overrides(["hardware=cpu", *override.split()])
    assert problem is not None and message in problem and "\n" not in problem, problem


def test_the_limits_name_the_key_that_raises_them_and_raising_it_runs():
    assert check_overrides(["hardware=cpu", "workload.rate=1e-3", "workload.num_requests=200"])  # 2e5 s
    assert (
        check_overrides(["hardware=cpu", "workload.rate=1e-3", "workload.num_requests=200", "limits.max_run_s=1e6"])
        is None
    )
    assert check_overrides(["hardware=cpu", "workload.num_requests=1000", "limits.max_memory_gb=0.001"])
    assert check_overrides(["hardware=cpu", "workload.num_requests=100", "limits.max_memory_gb=1"]) is None


def test_the_simulator_keeps_its_own_clock():
    """A simulated run's arrivals span simulated time: a low rate costs nothing."""
    assert check_overrides(["hardware=cpu", "executor=sim", "workload.rate=1e-9"]) is None


@pytest.mark.parametrize("override", ["seed=-1", "workload.rate=1e-9", "workload.num_requests=100000000"])
def test_the_probes_exit_2_in_one_line_before_allocating(tmp_path, override):
    out = subprocess.run(
        [sys.executable, "-m", "testbed", f"hydra.run.dir={tmp_path}", "hardware=cpu", override],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert len(out.stderr.strip().splitlines()) == 1 and "error: " in out.stderr
    assert not (tmp_path / "config.yaml").exists()  # refused before Hydra's job ran


# -- random overrides of every key ----------------------------------------------------------------
GROUPS = {
    "mode": ["colocated", "chunked", "disagg"],
    "model": ["tiny", "small", "llama3_8b"],
    "workload": ["poisson", "bursty", "onoff", "ramp", "multiturn", "mixed_tenants"],
    "hardware": ["cpu", "auto"],
}


@lru_cache(maxsize=None)
def composed(groups: tuple[str, ...]):
    """conf/ composed with these group choices by Hydra (cached: composing takes 0.2 s)."""
    from hydra import compose, initialize_config_dir

    register_configs()
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        return compose("config", overrides=list(groups))


def leaf_keys(node, prefix: str = "") -> list[str]:
    keys = []
    for key, value in node.items():
        keys += leaf_keys(value, f"{prefix}{key}.") if isinstance(value, dict) else [f"{prefix}{key}"]
    return keys


KEYS = leaf_keys(OmegaConf.to_container(composed(("hardware=cpu",)), resolve=False))
TEXT = st.from_regex(r"[A-Za-z_][A-Za-z0-9_./-]{0,10}", fullmatch=True)
VALUE = (
    st.integers().map(str)
    | st.integers(-5, 10**6).map(str)
    | st.floats().map(repr)
    | st.sampled_from(
        [
            "nan",
            "inf",
            "-inf",
            "1e-300",
            "5e-324",
            "1e308",
            "-0.0",
            "0",
            "-1",
            "''",
            "null",
            "true",
            "false",
            "[]",
            "[1,2]",
            "{}",
            "99999999999999999999",
        ]
    )
    | TEXT
)
OVERRIDES = st.tuples(
    st.dictionaries(st.sampled_from(sorted(GROUPS)), st.integers(0, 5), max_size=2),
    st.lists(st.tuples(st.sampled_from(KEYS), VALUE), min_size=1, max_size=3),
)


def compose_and_validate(groups: dict, values: list) -> str | None:
    """As check_overrides does it (compose, then config_problem), with the group choices composed
    once and the value overrides applied by Hydra's own override parser and merge (500 full
    compositions would take minutes)."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from testbed.config.command import _one_line

    choices = {"hardware": 0, **groups}  # hardware=cpu unless drawn: auto probes CUDA
    cfg = copy.deepcopy(composed(tuple(f"{g}={GROUPS[g][i % len(GROUPS[g])]}" for g, i in sorted(choices.items()))))
    try:
        ConfigLoaderImpl._apply_overrides_to_config(
            OverridesParser.create().parse_overrides([f"{k}={v}" for k, v in values]), cfg
        )
    except (HydraException, OmegaConfBaseException) as error:
        return _one_line(error)
    assert_built_as_merged(cfg)
    return config_problem(cfg)


def typed_or_refusal(convert, cfg):
    from omegaconf.errors import OmegaConfBaseException

    try:
        return convert(cfg)
    except (errors.TestbedError, OmegaConfBaseException) as error:
        return type(error), str(error)


def assert_built_as_merged(cfg) -> None:
    """to_config builds a composed config's dataclasses directly where every value has its field's
    type, and merges through OmegaConf otherwise: either way the Config (or the refusal) OmegaConf's
    merge gives."""
    assert typed_or_refusal(to_config, cfg) == typed_or_refusal(to_config_by_merge, cfg)


@settings(max_examples=500, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(OVERRIDES)
def test_any_override_of_any_key_is_taken_or_refused_in_one_line(overrides):
    groups, values = overrides
    problem = compose_and_validate(groups, values)  # any exception but the one-line refusal fails here
    assert problem is None or (problem and "\n" not in problem), problem


def test_the_property_covers_every_key_of_the_composed_config():
    assert len(KEYS) > 150 and {"seed", "limits.max_run_s", "workload.rate", "http.port"} <= set(KEYS)


def command_line(groups: dict, values: list) -> list[str]:
    """The same draw as `python -m testbed` arguments (hardware=cpu unless drawn)."""
    choices = {"hardware": 0, **groups}
    return [f"{g}={GROUPS[g][i % len(GROUPS[g])]}" for g, i in sorted(choices.items())] + [
        f"{k}={v}" for k, v in values
    ]


@pytest.mark.slow
@settings(max_examples=12, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(OVERRIDES)
def test_the_command_line_takes_or_refuses_any_override_in_one_line_with_exit_2(overrides):
    """The in-process property above, as a user meets it: `python -m testbed ... --cfg job` (the
    size, the checks and Hydra's own parser, nothing run) exits 0, or 2 with one `error:` line,
    never with a traceback. Twelve draws: each is a process of a few seconds."""
    args = command_line(*overrides)
    done = subprocess.run(
        [sys.executable, "-m", "testbed", *args, "--cfg", "job"], capture_output=True, text=True, timeout=300
    )
    assert "Traceback" not in done.stderr, (args, done.stderr[-3000:])
    assert done.returncode in (0, 2), (args, done.returncode, done.stderr[-2000:])
    if done.returncode == 2:
        errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1, (args, done.stderr)
