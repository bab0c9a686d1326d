"""The root configuration: typed dataclasses that validate every YAML file under conf/.

Hydra and OmegaConf stop here and in the studies layer. Below the studies nothing imports this
package (an import contract holds it): the executors take `cfg.serving` (testbed/serving.py) and
their own section. By concern:

    root.py      the root record (Config) and what it decides for itself
    checks.py    checks across sections: real TP workers' limits, the run's span and memory
    migrate.py   renamed keys and values: refused, and upgraded in stored results
    compose.py   conf/ composed into the record; a stored config read back; dotted overrides
    fast.py      the record built from plain values without OmegaConf's merge
    command.py   a command line checked before Hydra runs it
"""

from testbed.config.command import check_here, check_overrides, config_problem, output_dir_problem, override_keys
from testbed.config.compose import (
    compose_config,
    config_from_dict,
    register_configs,
    to_config,
    to_config_by_merge,
    with_overrides,
)
from testbed.config.migrate import renamed_key, renamed_value, upgraded
from testbed.config.root import CONF_DIR, EXECUTORS, Config, Decided, study_names
from testbed.errors import ConfigError

__all__ = [
    "CONF_DIR",
    "EXECUTORS",
    "Config",
    "ConfigError",
    "Decided",
    "check_here",
    "check_overrides",
    "compose_config",
    "config_from_dict",
    "config_problem",
    "output_dir_problem",
    "override_keys",
    "register_configs",
    "renamed_key",
    "renamed_value",
    "study_names",
    "to_config",
    "to_config_by_merge",
    "upgraded",
    "with_overrides",
]
