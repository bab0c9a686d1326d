"""testbed/sizing.py: a study's size is chosen before Hydra composes, as overrides beside the
user's, so the composed config (and `--cfg job`, and `.hydra/`) is what runs."""

from __future__ import annotations

import pytest

from testbed.cluster import layout
from testbed.errors import ConfigError
from testbed.sizing import choose, compose_sized, sized, sized_args, swept
from testbed.studies import catalog


def test_no_gpu_chooses_the_cpu_size_and_the_command_line_wins():
    sizing = choose(["+experiment=ratio_sweep", "workload.num_requests=5", "model=small"])
    assert sizing.choice == "cpu" and sizing.why == "no GPU will run"
    keys = [v.split("=", 1)[0] for v in sizing.values]
    assert "hardware.num_devices" in keys and "experiment.rates" in keys
    assert "workload.num_requests" not in keys and "model.name" not in keys  # set on the command line
    cfg = compose_sized(["+experiment=ratio_sweep", "workload.num_requests=5", "model=small"])
    assert (cfg.size, cfg.workload.num_requests, cfg.model.name, cfg.hardware.num_devices) == ("cpu", 5, "small", 3)


def test_a_box_without_a_gpu_driver_sizes_without_importing_torch(monkeypatch):
    """No driver, no CUDA device: torch is not asked (a second and more of every command's start)."""
    import subprocess
    import sys

    if layout.driver_loaded():
        pytest.skip("a GPU driver is loaded here: torch is asked")
    said = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from testbed.sizing import choose; "
            "print(choose(['+experiment=ratio_sweep']).choice, 'torch' in sys.modules)",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert said == ["cpu", "False"]
    monkeypatch.setattr(layout, "driver_loaded", lambda: True)  # a driver: torch decides (no device here)
    assert layout.cuda_count(compose_sized([]).hardware) == 0


def test_a_gpu_box_keeps_the_study_files_top_level(monkeypatch):
    monkeypatch.setattr(layout, "cuda_count", lambda hardware: 8)
    cfg = compose_sized(["+experiment=ratio_sweep"])
    assert cfg.size == "gpu" and cfg.model.name == "llama3_8b" and cfg.workload.num_requests == 400


def test_asking_for_a_size_wins_over_the_machine():
    assert compose_sized(["+experiment=ratio_sweep", "size=gpu"]).model.name == "llama3_8b"
    tiny = compose_sized(["+experiment=ratio_sweep", "size=tiny"])
    assert tiny.size == "tiny" and tiny.model.name == "tiny"  # the cpu size underneath...
    assert tiny.workload.num_requests == 6 and tiny.hardware.num_devices == 2  # ...the tiny run on top
    assert list(tiny.experiment.rates) == [20.0, 40.0]  # the study's own tiny values last
    with pytest.raises(ConfigError, match=r"size='huge' is not one of gpu, cpu, tiny"):
        sized(["+experiment=ratio_sweep", "size=huge"])


def test_every_study_composes_at_every_size():
    for study in catalog.STUDIES:
        for size in ("gpu", "cpu", "tiny"):
            study_arg = [] if study.name == "serve" else [f"+experiment={study.name}"]
            assert compose_sized([*study_arg, f"size={size}"]).size == size


def test_the_size_goes_beside_the_users_overrides_and_flags_stay():
    argv, sizing = sized_args(["+experiment=mode_compare", "workload.rate=3", "--cfg", "job"])
    assert argv[:2] == ["+experiment=mode_compare", "workload.rate=3"] and argv[-2:] == ["--cfg", "job"]
    assert argv[-3] == "size=cpu" and set(sizing.values) <= set(argv)
    assert sized_args(["--help"]) == (["--help"], None)


def test_a_multiruns_swept_values_are_left_to_hydra():
    assert swept("mode=colocated,chunked") and swept("seed=range(3)")
    assert not swept("experiment.rates=[1,2]") and not swept("workload.input_len={min:1,max:2}")
    argv, sizing = sized_args(["-m", "+experiment=mode_compare", "seed=1,2"])
    assert "seed=1,2" in argv and sizing.choice == "cpu"
