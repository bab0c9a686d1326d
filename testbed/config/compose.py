"""conf/ composed into the root record: Hydra's store, a composed DictConfig made typed and
validated, a stored config read back, and a copy with dotted keys set."""

from __future__ import annotations

from functools import lru_cache

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, ListConfig, OmegaConf

from testbed.config.fast import _built, _NotPlain, _replaced
from testbed.config.migrate import _check_renamed, renamed_key
from testbed.config.root import CONF_DIR, Config
from testbed.errors import ConfigError


def _writable(node: DictConfig) -> DictConfig:
    """Frozen dataclasses make read-only nodes; Hydra must still merge YAML and overrides."""
    OmegaConf.set_readonly(node, False)
    for key in node:
        child = node._get_node(key)
        if isinstance(child, DictConfig):
            _writable(child)
        elif isinstance(child, ListConfig):
            OmegaConf.set_readonly(child, False)
    return node


@lru_cache(maxsize=1)  # once a process: Hydra's store keeps it (a second structuring costs 0.1 s a compose)
def register_configs() -> None:
    node = _writable(OmegaConf.structured(Config))
    # the running study's own settings are its module's to check (testbed/studies/study.py own_settings):
    # `experiment.own.KEY=...` is set without Hydra's `+`, an unknown key refused there in one line
    OmegaConf.set_struct(node.experiment.own, False)
    ConfigStore.instance().store(name="base_config", node=node)


# renamed config keys: the old name is refused in one line that names the new one


def config_from_dict(stored: dict) -> Config:
    """A Config from its stored form (a results directory's config.yaml, or what torchrun's rank 0
    sends the other ranks with each point)."""
    return to_config(OmegaConf.create(stored))


def to_config(cfg: DictConfig) -> Config:
    """Typed, validated config from a composed DictConfig (Hydra's own keys dropped)."""
    container = _container(cfg)
    try:  # a composed config's values have their fields' types already: built directly, ten times faster
        typed = _built(Config, container)
    except _NotPlain:  # a value OmegaConf must convert, or refuse in its own words
        typed = _merged(container)
    return typed.validate()


def to_config_by_merge(cfg: DictConfig) -> Config:
    """to_config with every value merged into the schema by OmegaConf (what to_config's direct
    build must equal: tests/config/test_validation.py)."""
    return _merged(_container(cfg)).validate()


def _container(cfg: DictConfig) -> dict:
    """The composed config's plain values, Hydra's own keys dropped, renamed keys refused."""
    if "hydra" in cfg:  # Hydra's own node holds values only a job may resolve (hydra.job.num)
        cfg = OmegaConf.masked_copy(cfg, [key for key in cfg if key != "hydra"])
    container = OmegaConf.to_container(cfg, resolve=True)
    _check_renamed(container)
    return container


def _merged(container: dict) -> Config:
    return OmegaConf.to_object(OmegaConf.merge(_schema(), container))


@lru_cache(maxsize=1)
def _schema() -> DictConfig:
    """The Config schema as a writable node, built once (half of a conversion's time): merge
    copies it, never changes it."""
    return _writable(OmegaConf.structured(Config))


def with_overrides(cfg: Config, overrides: dict) -> Config:
    """A copy of `cfg` with dotted keys set ("cluster.num_prefill": 2), validated again."""
    problem = renamed_key(overrides)
    if problem:
        raise ConfigError(problem)
    try:  # a sweep's points set plain values: replaced directly, ten times faster than OmegaConf
        return _replaced(cfg, overrides).validate()
    except _NotPlain:
        pass
    node = OmegaConf.structured(cfg)
    _writable(node)
    for key, value in overrides.items():
        OmegaConf.update(node, key, value, merge=False)
    return OmegaConf.to_object(node).validate()


def compose_config(overrides: list[str]) -> Config:
    """The Config that conf/ composes with `overrides`, outside a Hydra app (a benchmark's command line)."""
    from hydra import compose, initialize_config_dir

    register_configs()
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        return to_config(compose("config", overrides=overrides))
