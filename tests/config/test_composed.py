"""One command line, one composition (testbed/composed.py): the size's values set on the composed
node give what Hydra composes with them on the command line, for every study's CPU and tiny size;
and the job Hydra records is the one that runs."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from testbed.composed import compose_once, compose_with_hydra, composes_once, hydra_context
from testbed.config import CONF_DIR, ConfigError, register_configs
from testbed.sizing import is_size

STUDIES = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))
VOLATILE = ("runtime", "job")  # a composition's time stamps and process facts; job is compared below


def recomposed(argv: list[str], counted: list) -> tuple:
    """What the command line composes to with the size's values on it (sizing.sized's way)."""

    def compose(overrides):
        counted.append(overrides)
        return compose_with_hydra(overrides)

    once = compose_once(argv, compose)
    values = [*once.sizing.values, f"size={once.sizing.choice}"]
    full = compose_with_hydra([*[a for a in argv if not is_size(a)], *values])
    return once, full


def plain(node) -> dict:
    body = OmegaConf.to_container(OmegaConf.masked_copy(node, [k for k in node if k != "hydra"]), resolve=True)
    return body


@pytest.mark.parametrize("size", ["cpu", "tiny"])
@pytest.mark.parametrize("name", STUDIES)
def test_the_size_set_on_the_one_composition_is_the_size_composed(name, size):
    register_configs()
    counted: list = []
    with hydra_context():
        once, full = recomposed([f"+experiment={name}", f"size={size}", "hardware=cpu"], counted)
    assert plain(once.node) == plain(full)
    assert list(once.node.hydra.overrides.task) == list(full.hydra.overrides.task)
    assert once.node.hydra.job.override_dirname == full.hydra.job.override_dirname
    assert len(counted) == 1  # no config group among the size's values: composed once
    assert once.config.size == size


def test_a_size_that_picks_a_config_group_composes_once_more():
    """executor=vllm's CPU size sets `hardware=cpu`: only a composition applies a group."""
    register_configs()
    counted: list = []
    with hydra_context():
        once, full = recomposed(["+experiment=ratio_sweep", "executor=vllm", "size=tiny"], counted)
    assert len(counted) == 2 and plain(once.node) == plain(full)


@pytest.mark.parametrize(
    "argv, problem",
    [
        (["workload.rate=abc"], "workload.rate"),
        (["bogus.key=1"], "bogus"),
        (["mode=0"], "a config group takes one of its names"),
        (["size=huge"], "size='huge' is not one of"),
    ],
)
def test_a_command_line_that_does_not_compose_is_one_line(argv, problem):
    register_configs()
    with hydra_context(), pytest.raises(ConfigError, match=problem) as error:
        compose_once(argv, compose_with_hydra)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    "argv, once",
    [
        ([], True),
        (["+experiment=ratio_sweep", "size=tiny"], True),
        (["--cfg", "job", "mode=disagg"], True),
        (["--cfg=job"], True),
        (["--cfg", "hydra"], False),
        (["-m", "mode=chunked,disagg"], False),
        (["--info"], False),
    ],
)
def test_only_overrides_and_cfg_job_take_the_one_composition(argv, once):
    assert composes_once(argv) == once
