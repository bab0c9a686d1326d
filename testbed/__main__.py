"""python -m testbed [+experiment=NAME] [key=value ...], or the `testbed` command"""

import json
import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from testbed.config import CONF_DIR, check_overrides, register_configs, to_config
from testbed.errors import TestbedError
from testbed.stopping import StopOnce

register_configs()


def draw_study_figures(name: str, sweep_dir: Path) -> list[Path]:
    """The analysis layer's figures of a study, handed to the studies layer (matplotlib loads only
    when a study draws)."""
    from analysis.standard_figures import study_figures

    return study_figures(name, sweep_dir)


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> None:
    from testbed.studies import figures
    from testbed.studies.runner import interrupted_note, run_job  # after Hydra: keeps `--help` fast

    figures.draw_with(draw_study_figures)
    hydra_cfg = HydraConfig.get()
    out_dir = Path(cfg.output_dir or hydra_cfg.runtime.output_dir)
    try:
        config = to_config(cfg)
        subdir = hydra_cfg.output_subdir  # None under torchrun's other ranks: they keep no record
        record_decided(config.decided, Path(hydra_cfg.runtime.output_dir) / subdir if subdir else None)
        run_job(config, out_dir)
    except TestbedError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(error.exit_code)
    except KeyboardInterrupt as stop:
        print(f"interrupted: {interrupted_note(cfg.experiment.name, out_dir, stop)}", file=sys.stderr)
        sys.exit(130)


def record_decided(decided: dict, hydra_dir: Path | None) -> None:
    """Print what the configuration chose for itself and keep it beside Hydra's record
    (`.hydra/decided.yaml`), so what ran is what the record says."""
    if not decided:
        return
    print("decided: " + ", ".join(f"{key}={value} ({why})" for key, (value, why) in decided.items()))
    if hydra_dir is not None and hydra_dir.is_dir():
        lines = [f"{key}: {json.dumps(value)}  # {why}" for key, (value, why) in decided.items()]
        (hydra_dir / "decided.yaml").write_text("\n".join(lines) + "\n")


def quiet_rank_args(argv: list[str], env=os.environ) -> list[str]:
    """Under torchrun, ranks other than 0 write nothing (rank 0 writes the results): no Hydra run
    directory, no `.hydra/` record, no job log file."""
    if env.get("RANK", "0") == "0" or "LOCAL_WORLD_SIZE" not in env:
        return argv
    ours = ["hydra.run.dir=.", "hydra.output_subdir=null", f"hydra.job_logging.handlers.file.filename={os.devnull}"]
    return [a for a in argv if not a.startswith(("hydra.run.dir=", "hydra.output_subdir="))] + ours


def with_size(argv: list[str]) -> list[str]:
    """The study's size added to the command line (testbed/sizing.py), said in one line. A command
    line that does not compose is left as it is: check_overrides says what is wrong with it."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from testbed.sizing import sized_args

    try:
        argv, sizing = sized_args(argv)
    except (HydraException, OmegaConfBaseException, ValueError, TestbedError):
        return argv
    if sizing is not None and sizing.values:
        print(
            f"size={sizing.choice} ({sizing.why}; size=gpu runs the study's GPU size, a key set here wins): "
            + " ".join(sizing.values),
            file=sys.stderr,
        )
    return argv


def cli() -> None:
    StopOnce().install()  # SIGINT/SIGTERM: workers stopped, finished requests and points kept; later signals wait
    sys.argv[1:] = with_size(quiet_rank_args(sys.argv[1:]))
    problem = check_overrides(sys.argv[1:])
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
    try:
        main()
    finally:
        StopOnce.settle()


if __name__ == "__main__":
    cli()
