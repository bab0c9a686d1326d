"""The step profiler (testbed/measure/step_profile.py): a quick profile of a short model fits a
cost model, the KV it stages is what the device holds, and bad input is one line."""

import dataclasses
import json

import pytest

from testbed.engine import EngineConfig
from testbed.errors import ConfigError
from testbed.measure.step_profile import profile_engine
from testbed.model.config import ModelConfig
from testbed.sim.cost_model import CostModel

KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # tiny: K and V x 2 layers x 2 KV heads x head dim 16, float32


def test_quick_profile_of_a_short_model():
    profile = profile_engine(ModelConfig(name="tiny", max_model_len=128), EngineConfig(), "cpu", quick=True)
    json.dumps(profile, allow_nan=False)
    assert profile["transfer_source"] == "pack" and len(profile["samples"]["step"]) >= 6
    ipc = profile["samples"]["transfer_ipc"]
    assert profile["transfer_ipc_source"] == "ipc-shm" and [r["bytes"] for r in ipc] == sorted(r["bytes"] for r in ipc)
    assert all(r["seconds"] > 0 for r in ipc) and ipc[-1]["bytes"] >= 128 * KV_BYTES_PER_TOKEN
    assert CostModel.from_profile(profile).step_time(64, 32, 4, 400) > 0


@pytest.mark.parametrize("free_gib, tokens", [(63, (256 << 10, 512 << 10)), (124, (512 << 10, 512 << 10 + 1))])
def test_profile_stages_the_kv_the_device_holds(free_gib, tokens):
    # Llama-3-8B in bf16 (16 GB of weights): an 80 GB GPU leaves about 63 GiB, a 141 GB one about 124
    import torch

    from testbed.measure.step_profile import kv_token_budget
    from testbed.model.config import PRESETS

    args = dataclasses.replace(PRESETS["llama3_8b"], max_model_len=32768)
    budget = kv_token_budget(args, torch.bfloat16, 16, free_gib << 30, quick=False)
    assert tokens[0] <= budget < tokens[1]
    kv_bytes = budget * 2 * args.num_layers * args.num_kv_heads * args.head_dim * 2
    assert kv_bytes <= 0.6 * (free_gib << 30)
    assert kv_token_budget(args, torch.float32, 16, None, quick=False) == 1 << 16  # CPU: as before


def test_profile_on_a_gpu_too_full_for_its_context_stops_in_one_line():
    import torch

    from testbed.measure.step_profile import kv_token_budget
    from testbed.model.config import PRESETS

    with pytest.raises(ConfigError, match="lower model.max_model_len"):
        kv_token_budget(PRESETS["llama3_8b"], torch.bfloat16, 16, 2 << 30, quick=False)


def test_the_profiler_s_command_line_reports_bad_input_in_one_line(tmp_path):
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "testbed.measure.step_profile", "--model", "nope", "--out", str(tmp_path / "p.json")],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and not (tmp_path / "p.json").exists()
    assert done.stderr.strip().splitlines() == [done.stderr.strip()] and "is not a preset" in done.stderr
