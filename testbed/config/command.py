"""A command line checked before Hydra runs it: unknown keys, mistyped values, renamed keys, the
run's cost and what this machine must have, and a results directory that can be written; each
refused in one line."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from omegaconf import DictConfig

from testbed.config.checks import check_budget, worker_bytes
from testbed.config.compose import to_config
from testbed.config.migrate import renamed_key, renamed_value
from testbed.config.root import CONF_DIR, Config
from testbed.errors import ConfigError, TestbedError


def override_keys(overrides: list[str]) -> set[str]:
    """Keys a command line set ("+experiment=x", "model=small", "slo.ttft_s=1" -> experiment, model, slo.ttft_s)."""
    return {o.split("=", 1)[0].lstrip("+~") for o in overrides if "=" in o}


# flags that compose nothing, or compose per job (a multirun): left to Hydra
UNCHECKED_FLAGS = (
    "-m",
    "--multirun",
    "-h",
    "--help",
    "--hydra-help",
    "--info",
    "-i",
    "--version",
    "--shell-completion",
    "-sc",
)


def check_overrides(argv: list[str]) -> str | None:
    """Compose the config the command line asks for before Hydra runs it, so that an unknown key
    or a mistyped value is one line (Hydra prints several and exits 1): `--cfg job` included. A
    multirun's sweeps and the help and info flags are left to Hydra."""
    from hydra import compose as compose_hydra
    from hydra import initialize_config_dir

    problem = output_dir_problem(argv)
    if problem or any(a.split("=", 1)[0] in UNCHECKED_FLAGS for a in argv):
        return problem
    # Hydra's flags and their values (`--cfg job`) are not overrides; `--cfg job` composes as a run does
    overrides = [a for a in argv if "=" in a and not a.startswith("-") and not a.startswith("hydra.")]
    problem = renamed_key(sorted(override_keys(overrides))) or renamed_value(
        dict(o.lstrip("+~").split("=", 1) for o in overrides if "=" in o)
    )
    if problem:
        return problem

    def compose(overrides: list[str]) -> DictConfig:
        with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
            return compose_hydra("config", overrides=overrides)

    composed, problem = compose_problem(compose, overrides)
    return problem or config_problem(composed)


def compose_problem(compose: Callable[[list[str]], DictConfig], overrides: list[str]) -> tuple:
    """(the composed node, None), or (None, why it does not compose, in one line)."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        return compose(overrides), None
    except (HydraException, OmegaConfBaseException) as error:
        return None, _one_line(error)
    except ValueError as error:  # Hydra's own, e.g. a number given for a config group (`mode=0`)
        return None, f"{_one_line(error)} (in: {' '.join(overrides)}); a config group takes one of its names"


def config_problem(composed: DictConfig) -> str | None:
    """The composed config's refusal in one line, or None: every value's type, range and relations
    and the run's estimated cost, checked once before Hydra makes a run directory."""
    try:
        typed_and_checked(composed)
    except ConfigError as error:
        return str(error)
    return None


def typed_and_checked(composed: DictConfig) -> Config:
    """The typed config, its memory and this machine checked; a ConfigError in one line otherwise."""
    from omegaconf.errors import OmegaConfBaseException

    try:
        typed = to_config(composed)
        # the workers' memory here, not in validate: code builds configs it never runs on CPU workers
        check_budget(typed, typed.model.args(), worker_bytes(typed, typed.model.args()))
        check_here(typed)
    except ConfigError:
        raise
    except TestbedError as error:
        raise ConfigError(str(error)) from error
    except OmegaConfBaseException as error:  # a value its field's type cannot hold
        raise ConfigError(_one_line(error)) from error
    return typed


def check_here(cfg: Config) -> None:
    """What the run needs from this machine that a command line can check before any worker starts
    (each is checked again where it is used: a trace may vanish between compose and run): the trace
    file (`workload.path`, found as the run will find it), and flash-attn importing where the real
    executor's workers are asked for `engine.attention_backend=flash`."""
    if cfg.workload.path:
        from testbed.workload.traces import resolve_trace_path

        resolve_trace_path(cfg.workload.path)
    if cfg.executor == "real" and cfg.engine.attention_backend == "flash":
        from importlib.util import find_spec

        from testbed.model.kv_layout import ATTENTION_BACKENDS

        # not installed: said without importing torch; installed: the workers' own test of the import
        if find_spec("flash_attn") is None or not _flash_attn_imports():
            others = ", ".join(b for b in ATTENTION_BACKENDS if b != "flash")
            raise ConfigError(
                "engine.attention_backend=flash needs flash-attn, which does not import here (pip install "
                f"flash-attn on a CUDA machine); engine.attention_backend is one of {others} without it "
                "(auto takes the fastest that runs)"
            )


def _flash_attn_imports() -> bool:
    from testbed.model.attention import FLASH_ATTN_AVAILABLE

    return FLASH_ATTN_AVAILABLE


OUTPUT_KEYS = ("hydra.run.dir", "hydra.sweep.dir", "output_dir")


def output_dir_problem(argv: list[str]) -> str | None:
    """Where results go must be writable before Hydra tries (its own failure is a traceback): the
    directory is created (Hydra would create it next) and probed, as every run's results are."""
    from testbed.metrics.results_dir import write_problem

    given = {a.split("=", 1)[0].lstrip("+"): a.split("=", 1)[1] for a in argv if "=" in a}
    for key in OUTPUT_KEYS:
        if key not in given or "${" in given[key]:  # interpolations are Hydra's to resolve
            continue
        problem = write_problem(Path(given[key]).expanduser())
        if problem:
            return f"{key}={given[key]} cannot be written ({problem}); name a writable directory"
    return None


def _one_line(error: BaseException) -> str:
    parts = []
    while error is not None and len(parts) < 3:
        text = " ".join(
            line.strip()
            for line in str(error).splitlines()
            if line.strip() and not line.strip().startswith(("full_key", "object_type", "reference_type"))
        )
        text = text.split(" Config search path:")[0]
        if text and text not in parts:
            parts.append(text)
        error = error.__cause__
    return ": ".join(parts)
