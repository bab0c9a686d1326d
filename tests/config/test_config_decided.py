"""What the configuration decides for itself (testbed/config/root.py `Config.decided`) is said and kept:
printed by the entry point and written to `.hydra/decided.yaml`, so Hydra's record is what ran."""

from __future__ import annotations

import yaml

from testbed.__main__ import record_decided
from testbed.config import compose_config


def test_an_unset_block_size_and_prefix_caching_turned_on_are_decided_with_a_reason():
    cfg = compose_config(["mode=disagg", "kv_transfer.multiturn=incremental"])
    assert cfg.engine.enable_prefix_caching and cfg.engine.block_size == 16
    assert set(cfg.decided) == {"engine.enable_prefix_caching", "engine.block_size"}
    assert all(d.why for d in cfg.decided.values())


def test_a_value_set_on_the_command_line_is_not_decided():
    cfg = compose_config(["engine.block_size=32", "engine.enable_prefix_caching=true"])
    assert cfg.decided == {}


def test_decisions_are_printed_and_kept_beside_hydras_record(tmp_path, capsys):
    cfg = compose_config([])
    record_decided(cfg.decided, tmp_path)
    assert "engine.block_size=16" in capsys.readouterr().out
    assert yaml.safe_load((tmp_path / "decided.yaml").read_text()) == {"engine.block_size": 16}
