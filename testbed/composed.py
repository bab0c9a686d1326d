"""A command line composed once: sized, checked, then shown (`--cfg job`) or run as Hydra runs a job.

    argv -> compose (the user's overrides) -> size (testbed/sizing.py) -> check -> show | run

`@hydra.main` composes a run twice (once for its mode, once for the job), and the sizing and the
checks before it composed once each. Here the one composition serves all of them: the size's
values are applied to it as Hydra applies a command line's values (after the config groups), and
the job runs on it through Hydra's own `run_job` (the run directory, the `.hydra/` record, job
logging, callbacks). Only a size that picks a config group (`hardware=cpu`, executor=vllm's CPU
size) composes once more. A multirun, `--cfg hydra`, `--info` and Hydra's other flags stay with
`@hydra.main` (testbed/__main__.py).
"""

from __future__ import annotations

import sys
from typing import Callable, NamedTuple, Optional

from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from testbed.config import CONF_DIR, Config, ConfigError, renamed_key, renamed_value
from testbed.config.command import compose_problem, output_dir_problem, override_keys, typed_and_checked
from testbed.sizing import Sizing, choose, is_override, is_size

JOB_NAME = "__main__"  # @hydra.main's name for a job run from testbed/__main__.py: the log file's name
SHOW_JOB = ("--cfg", "-c")


class Composed(NamedTuple):
    node: DictConfig  # with its `hydra` node: what runs, and what `.hydra/` records
    config: Config  # typed and checked
    sizing: Optional[Sizing]


def composes_once(argv: list[str]) -> bool:
    """Only overrides, or `--cfg job`: the path that composes once. Anything else is Hydra's."""
    rest = [a for a in argv if a not in ("--cfg=job", "job", *SHOW_JOB)]
    shown = [a for a, b in zip(argv, argv[1:] + [""]) if a in SHOW_JOB and b != "job"]
    return not shown and all(is_override(a) for a in rest)


def only_overrides(argv: list[str]) -> bool:
    return all(is_override(a) for a in argv)


def compose_once(argv: list[str], compose: Callable[[list[str]], DictConfig], sized: bool = True) -> Composed:
    """The command line's configuration, sized (unless `sized` is false: the HTTP server serves what
    it is given) and checked; a ConfigError says in one line what is wrong. `compose` composes
    overrides with the `hydra` node (inside Hydra's initialization)."""
    problem = output_dir_problem(argv)
    overrides = [a for a in argv if is_override(a)]
    user = [o for o in overrides if not o.startswith("hydra.")]
    problem = problem or renamed_key(sorted(override_keys(user)))
    problem = problem or renamed_value(dict(o.lstrip("+~").split("=", 1) for o in user))
    if problem:
        raise ConfigError(problem)
    if not sized:
        node = _composed(compose, overrides)
        return Composed(node, typed_and_checked(node), None)
    rest = [o for o in overrides if not is_size(o)]
    node = _composed(compose, rest)
    sizing = choose(overrides, lambda _: node)
    values = [*sizing.values, f"size={sizing.choice}"]
    if any(_is_group(node, v) or v.startswith(("+", "~")) for v in values):
        node = _composed(compose, [*rest, *values])  # a config group: only a composition applies it
    else:
        apply_values(node, values)
    from testbed.studies.catalog import study  # as sizing does: the studies load where a command composes

    config = typed_and_checked(node)
    study(config.experiment.name).own_settings(config)  # the study's own settings, refused before it is said
    return Composed(node, config, sizing)


def _composed(compose: Callable[[list[str]], DictConfig], overrides: list[str]) -> DictConfig:
    node, problem = compose_problem(compose, overrides)
    if problem:
        raise ConfigError(problem)
    return node


def _is_group(node: DictConfig, value: str) -> bool:
    return value.split("=", 1)[0] in node.hydra.runtime.choices


def apply_values(node: DictConfig, values: list[str]) -> None:
    """Values of plain keys set on a composed node as Hydra sets a command line's (after the config
    groups, merged), and recorded as its overrides: what the node would be composed with them."""
    from hydra._internal.config_loader_impl import get_overrides_dirname  # the record's own rule
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    for override in parser.parse_overrides(values):
        OmegaConf.update(node, override.key_or_group, override.value(), merge=True)
    with read_write(node.hydra), open_dict(node.hydra):
        node.hydra.overrides.task.extend(values)
        job = node.hydra.job
        task = parser.parse_overrides(list(node.hydra.overrides.task))
        names = job.config.override_dirname
        job.override_dirname = get_overrides_dirname(task, names.exclude_keys, names.item_sep, names.kv_sep)


def said(sizing: Optional[Sizing]) -> None:
    """The size chosen, in one line on stderr, where it added values."""
    if sizing is not None and sizing.values:
        print(
            f"size={sizing.choice} ({sizing.why}; size=gpu runs the study's GPU size, a key set here wins): "
            + " ".join(sizing.values),
            file=sys.stderr,
        )


def run_composed(node: DictConfig, task: Callable[[DictConfig], None]) -> None:
    """The task run on the composed node as `@hydra.main` runs one job: inside Hydra's
    initialization, with its callbacks."""
    from hydra._internal.callbacks import Callbacks  # a job Hydra did not compose itself still has them
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.utils import configure_log, run_job
    from hydra.types import HydraContext, RunMode

    with read_write(node.hydra):
        node.hydra.mode = RunMode.RUN
    configure_log(node.hydra.hydra_logging, node.hydra.verbose)
    callbacks = Callbacks(node)
    callbacks.on_run_start(config=node, config_name="config")
    context = HydraContext(config_loader=GlobalHydra.instance().config_loader(), callbacks=callbacks)
    ret = run_job(task, node, "hydra.run.dir", None, context, configure_logging=True)
    callbacks.on_run_end(config=node, config_name="config", job_return=ret)
    _ = ret.return_value  # a failed job's exception, raised here


def hydra_context(version_base: str = "1.3"):
    """Hydra initialized on conf/ for the job, as `@hydra.main` initializes it."""
    from hydra import initialize_config_dir

    return initialize_config_dir(version_base=version_base, config_dir=str(CONF_DIR), job_name=JOB_NAME)


def compose_with_hydra(overrides: list[str]) -> DictConfig:
    from hydra import compose

    return compose("config", overrides=overrides, return_hydra_config=True)
