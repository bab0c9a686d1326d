"""A study's size, chosen before Hydra composes: `size=gpu|cpu|tiny`.

A study's file gives its GPU size as its values and its CPU size under `experiment.sizes.cpu`
(what two cores finish in minutes); `tiny` is the CPU size with the study's catalog record's
`tiny` on top (the least that still exercises it, as the tests run it). The chosen size's values
are overrides after the user's: set on the command line's one composition as Hydra sets them
(testbed/composed.py), or added to a multirun's command line for Hydra to compose; either way
`--cfg job`, `.hydra/config.yaml` and `.hydra/overrides.yaml` show what runs. Unset, the size is `cpu` where
the run will use no GPU (no CUDA device, not a remote server's load test, not a simulated GPU),
else `gpu`. A key the command line sets wins over the size's (`model=small` keeps the small model).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

from omegaconf import DictConfig, OmegaConf

from testbed.config import CONF_DIR, Config, ConfigError, override_keys, register_configs, to_config
from testbed.errors import TestbedError
from testbed.experiment import SIZES

Compose = Callable[[list[str]], DictConfig]


class Sizing(NamedTuple):
    choice: str  # one of SIZES
    why: str  # how it was chosen
    values: list[str]  # the overrides it adds, the command line's keys left out


def compose_raw(overrides: list[str]) -> DictConfig:
    """conf/ composed with `overrides` and nothing added."""
    from hydra import compose, initialize_config_dir

    register_configs()
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        return compose("config", overrides=overrides)


def compose_sized(overrides: list[str]) -> Config:
    """The Config a command line of these overrides runs: its size applied (tests, analysis.render).
    A size with no values of its own (a config with no study sizes) only sets `size`, so the
    composition that chose it is the one that runs: one composition instead of two."""
    rest = [o for o in overrides if not is_size(o)]
    composed = compose_raw(rest)
    sizing = choose(overrides, lambda _: composed)
    if sizing.values:
        composed = compose_raw([*rest, *sizing.values, f"size={sizing.choice}"])
    else:
        composed.size = sizing.choice
    return to_config(composed)


def sized(overrides: list[str], compose: Compose = compose_raw) -> list[str]:
    """`overrides` with the size's values and `size=<choice>` added."""
    rest = [o for o in overrides if not is_size(o)]
    sizing = choose(overrides, compose)
    return [*rest, *sizing.values, f"size={sizing.choice}"]


def choose(overrides: list[str], compose: Compose = compose_raw) -> Sizing:
    """The size the overrides ask for (the last `size=`), else the machine's, and its values."""
    given = [o.split("=", 1)[1] for o in overrides if is_size(o)]
    if given and given[-1] not in SIZES:
        raise ConfigError(f"size={given[-1]!r} is not one of {', '.join(SIZES)}")
    rest = [o for o in overrides if not is_size(o)]
    composed = compose(rest)
    if given:
        choice, why = given[-1], "asked for"
    else:
        choice, why = default_size(to_config(composed))
    values = size_values(composed, choice)
    explicit = override_keys(rest) - {"experiment"}  # `+experiment=NAME` picks the study, not its values
    kept = [v for v in values if not any(related(v.split("=", 1)[0], e) for e in explicit)]
    return Sizing(choice, why, kept)


def sized_args(argv: list[str], compose: Compose = compose_raw) -> tuple[list[str], Sizing | None]:
    """A command line's arguments with the size applied, beside the user's overrides (Hydra reads
    them in one list). Flags stay where they are; Hydra's own keys and a multirun's swept values
    are left out of the composition that chooses the size."""
    overrides = [a for a in argv if is_override(a)]
    if not overrides and not any(a == "--cfg" for a in argv) and any(a.startswith("-") for a in argv):
        return argv, None  # --help, --info: nothing composes
    plain = [o for o in overrides if not o.startswith("hydra.") and not swept(o)]
    sizing = choose(plain, compose)
    added = [*sizing.values, f"size={sizing.choice}"]
    rest = [a for a in argv if not is_size(a)]
    last = max((i for i, a in enumerate(rest) if is_override(a)), default=-1)
    return [*rest[: last + 1], *added, *rest[last + 1 :]], sizing


def is_size(arg: str) -> bool:
    return "=" in arg and arg.lstrip("+").split("=", 1)[0] == "size"


def is_override(arg: str) -> bool:
    return "=" in arg and not arg.startswith("-")


def swept(override: str) -> bool:
    """A multirun's value list or sweep function (`mode=colocated,chunked`, `seed=range(3)`)."""
    value = override.split("=", 1)[1]
    depth = 0
    for c in value:
        if c in "[{(":
            depth += 1
        elif c in "]})":
            depth -= 1
        elif c == "," and depth == 0:
            return True
    return value.startswith(("range(", "choice(", "glob(", "interval("))


def default_size(cfg: Config) -> tuple[str, str]:
    """cpu where the run will use no GPU, else gpu; and why."""
    from testbed.cluster.layout import cuda_count

    if cfg.executor == "http":
        return "gpu", "a remote server's load test: its hardware, not this machine's, sets the size"
    if simulates_gpu(cfg):
        return "gpu", "simulated on a GPU's profile"
    if cuda_count(cfg.hardware) > 0:
        return "gpu", "CUDA devices found"
    return "cpu", "no GPU will run"


def simulates_gpu(cfg: Config) -> bool:
    """A simulated study (executor=sim, or one whose points all are: Study.simulated) on a GPU of the analytical
    table or a profile measured on a GPU: it keeps its GPU size, the model included, which a
    GPU's profile describes."""
    from testbed.perf.resolve import is_gpu
    from testbed.studies.catalog import study

    specs = [s for s in (cfg.sim.profile, cfg.sim.prefill_profile, cfg.sim.decode_profile) if s is not None]
    simulated = cfg.executor == "sim" or study(cfg.experiment.name).simulated
    return simulated and any(is_gpu(spec) or measured_on_gpu(spec) for spec in specs)


def measured_on_gpu(spec: str) -> bool:
    """A profile file measured on CUDA; a damaged one is no GPU here: the run's own checks refuse
    it in one line, naming the file."""
    from testbed.perf.resolve import profile_device

    try:
        return profile_device(spec) == "cuda"
    except (OSError, TestbedError):
        return False


def size_values(composed: DictConfig, choice: str) -> list[str]:
    """The size's values as overrides: none for gpu; the study's sizes.cpu for cpu; for tiny the
    cpu values, then the study's tiny run (testbed/studies/catalog.py) over them."""
    if choice == "gpu":
        return []
    sizes = OmegaConf.to_container(composed.experiment.sizes, resolve=True)
    if composed.executor == "vllm":
        return vllm_size_values(composed.experiment.name, sizes.get("vllm_cpu") or {}, choice)
    values = {key: f"{key}={override_value(value)}" for key, value in (sizes.get("cpu") or {}).items()}
    if choice == "tiny":
        from testbed.studies.catalog import study, tiny_values

        tiny = tiny_values(study(composed.experiment.name))
        keys = override_keys(tiny)  # each wins over the cpu values at, above and below it (`hardware=cpu`)
        values = {k: v for k, v in values.items() if not any(related(k, key) for key in keys)}
        values.update({override.split("=", 1)[0]: override for override in tiny})
    return list(values.values())


def vllm_size_values(name: str, own: dict, choice: str) -> list[str]:
    """executor=vllm on CPU: the catalog's VLLM_CPU_BASE (real vLLM instances, one core each, rates
    one core serves), the study's sizes.vllm_cpu over it; tiny adds VLLM_TINY (a handful of requests)."""
    from testbed.studies.catalog import VLLM_CPU_BASE, VLLM_TINY

    values = {o.split("=", 1)[0]: o for o in VLLM_CPU_BASE}
    values.update({key: f"{key}={override_value(value)}" for key, value in own.items()})
    if choice == "tiny":
        values.update({o.split("=", 1)[0]: o for o in VLLM_TINY})
    return list(values.values())


def related(a: str, b: str) -> bool:
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")


def override_value(value) -> str:
    """A value in Hydra's override grammar: null, true/false, numbers, [a,b], quoted strings
    where they hold what the grammar reads otherwise."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(override_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{override_value(v)}" for k, v in value.items()) + "}"
    text = str(value)
    plain = text and all(c.isalnum() or c in "_-./:" for c in text) and not text[0].isdigit()
    return text if plain else "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"
