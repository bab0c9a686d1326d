"""Tracker configuration (Hydra structured config for the `tracker` group).

Not frozen: OmegaConf makes a frozen dataclass config read-only, and Hydra could then merge
neither conf/tracker/*.yaml nor command-line overrides onto it (see testbed/workload/config.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import List, Mapping, Optional

from testbed.errors import ConfigError

TRACKER_NAMES = ("none", "wandb")
# No "online" default anywhere: a run on a machine without network must never wait on W&B.
TRACKER_MODES = ("offline", "online", "disabled")
# W&B's own aliases (wandb.init accepts them too): dryrun is offline, run is online
MODE_ALIASES = {"dryrun": "offline", "run": "online"}
DEFAULT_MODE, DEFAULT_PROJECT = "offline", "testbed"


@dataclass
class TrackerConfig:
    """Where run summaries, tables and figures go besides the results directory.

    name: none (results directory only) or wandb. mode (wandb only): offline writes runs for a
    later `wandb sync`; online needs network and a login; disabled calls W&B but writes nothing.
    mode, project and dir left unset (null) come from WANDB_MODE, WANDB_PROJECT and WANDB_DIR,
    else offline, "testbed" and the results directory; a value set here wins over the
    environment. max_table_rows caps each logged table and time series (W&B charts slow down
    beyond ~10k points per key).
    """

    name: str = "none"  # none (results directory only) | wandb
    mode: Optional[str] = None  # W&B mode: offline | online | disabled; None: WANDB_MODE, else offline
    project: Optional[str] = None  # W&B project; None: WANDB_PROJECT, else "testbed"
    entity: Optional[str] = None  # W&B entity (user or team) passed to wandb.init; None: W&B's default
    dir: Optional[str] = None  # W&B's directory; None: WANDB_DIR, else the results directory
    max_table_rows: int = 10000  # most rows logged per table or time series
    tags: List[str] = field(default_factory=list)  # tags given to each W&B run

    def validate(self) -> "TrackerConfig":
        if self.mode in MODE_ALIASES:
            self.mode = MODE_ALIASES[self.mode]
        if self.name not in TRACKER_NAMES:
            raise ConfigError(f"tracker.name must be one of {', '.join(TRACKER_NAMES)} (got {self.name!r})")
        if self.mode is not None and self.mode not in TRACKER_MODES:
            raise ConfigError(f"tracker.mode must be one of {', '.join(TRACKER_MODES)} (got {self.mode!r})")
        if self.project is not None and not self.project:
            raise ConfigError("tracker.project must be a non-empty string")
        if self.max_table_rows < 1:
            raise ConfigError(f"tracker.max_table_rows must be >= 1 (got {self.max_table_rows})")
        return self

    def resolved(self, env: Optional[Mapping[str, str]] = None) -> "TrackerConfig":
        """A copy with mode, project and dir filled in: this config's, else the environment's,
        else the defaults (dir None: the results directory). Done once, when a tracker is made."""
        env = os.environ if env is None else env
        mode = self.mode or env.get("WANDB_MODE") or DEFAULT_MODE
        mode = MODE_ALIASES.get(mode, mode)
        if mode not in TRACKER_MODES:  # only the environment can get here: validate() checked ours
            raise ConfigError(
                f"WANDB_MODE={mode!r} in the environment is not one of {', '.join(TRACKER_MODES)} "
                f"(or W&B's aliases {', '.join(MODE_ALIASES)}); "
                f"unset it or set tracker.mode"
            )
        project = self.project or env.get("WANDB_PROJECT") or DEFAULT_PROJECT
        return replace(self, mode=mode, project=project, dir=self.dir or env.get("WANDB_DIR") or None).validate()
