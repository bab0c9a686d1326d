"""Tracker configuration (Hydra structured config for the `tracker` group).

Not frozen: OmegaConf makes a frozen dataclass config read-only, and Hydra could then merge
neither conf/tracker/*.yaml nor command-line overrides onto it (see testbed/workload/config.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from testbed.errors import ConfigError

TRACKER_NAMES = ("none", "wandb")
# No "online" default anywhere: a run on a machine without network must never wait on W&B.
TRACKER_MODES = ("offline", "online", "disabled")


@dataclass
class TrackerConfig:
    """Where run summaries, tables and figures go besides the results directory.

    name: none (results directory only) or wandb. mode (wandb only): offline writes runs under
    the results directory for a later `wandb sync`; online needs network and a login; disabled
    calls W&B but writes nothing. max_table_rows caps each logged table (W&B charts slow down
    beyond ~10k points per key).
    """

    name: str = "none"
    mode: str = "offline"
    project: str = "testbed"
    entity: Optional[str] = None
    max_table_rows: int = 10000
    tags: List[str] = field(default_factory=list)

    def validate(self) -> "TrackerConfig":
        if self.name not in TRACKER_NAMES:
            raise ConfigError(f"tracker.name must be one of {', '.join(TRACKER_NAMES)} (got {self.name!r})")
        if self.mode not in TRACKER_MODES:
            raise ConfigError(f"tracker.mode must be one of {', '.join(TRACKER_MODES)} (got {self.mode!r})")
        if not self.project:
            raise ConfigError("tracker.project must be a non-empty string")
        if self.max_table_rows < 1:
            raise ConfigError(f"tracker.max_table_rows must be >= 1 (got {self.max_table_rows})")
        return self
