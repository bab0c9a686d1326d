"""python -m testbed [+experiment=NAME] [key=value ...], or the `testbed` command. Importing this
module loads no Hydra, config or torch: `--help` answers from the conf/ listing alone, and a
worker that runs the `testbed` script's main again pays nothing for it."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from testbed.config import Config, Decided

HELP_FLAGS = ("--help", "-h")  # Hydra's own (its full config dump) stays behind --hydra-help and --cfg job
EXAMPLES = (
    ("python -m testbed", "one run of the default job (tiny model, chunked, Poisson arrivals)"),
    ("python -m testbed +experiment=ratio_sweep size=tiny", "the main study at its smallest size"),
    ("python -m testbed +experiment=ratio_sweep", "the main study at this machine's size (cpu or gpu)"),
    ("python -m testbed +experiment=rate_sweep executor=sim", "a study in the simulator, in seconds"),
    ("python -m testbed mode=disagg hardware.num_devices=2 workload.rate=8", "one run, 1P1D at 8 req/s"),
)


def conf_dir() -> Path:
    """Where the Hydra configs are, by testbed.config.CONF_DIR's rule (conf/ beside testbed/ in a
    checkout, testbed/conf/ in a wheel), without importing it: tests/config/test_cli.py holds the two equal."""
    packaged = Path(__file__).resolve().parent / "conf"
    return packaged if (packaged / "config.yaml").is_file() else Path(__file__).resolve().parents[1] / "conf"


def described(path: Path) -> str:
    """A study's first sentence from its file's opening comment (after `# @package`)."""
    comment = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        if not line.startswith("# @package"):
            comment.append(line.lstrip("#").strip())
    text = " ".join(comment)
    first = re.split(r"(?<=[a-z)]\.)\s+(?=[A-Z])", text, maxsplit=2)  # sentences ("1:N-1 .. N-1:1" is none)
    said = first[0] if len(first[0]) >= 40 or len(first) == 1 else f"{first[0]} {first[1]}"
    return said if len(said) <= 96 else said[:93].rsplit(" ", 1)[0].rstrip(" ,;:(") + " ..."


def usage(conf: Path | None = None) -> str:
    """The short answer to `--help`: the studies, the config groups and their options, examples."""
    conf = conf or conf_dir()
    studies = sorted((conf / "experiment").glob("*.yaml"))
    width = max(len(p.stem) for p in studies)
    groups = sorted(d for d in conf.iterdir() if d.is_dir() and d.name != "experiment" and any(d.glob("*.yaml")))
    example_width = max(len(command) for command, _ in EXAMPLES)
    return "\n".join(
        [
            "usage: python -m testbed [+experiment=STUDY] [size=tiny|cpu|gpu] [key=value ...]   (or: testbed ...)",
            "",
            "One serving job by default; +experiment=STUDY runs a study: its points, figures and verdict.",
            "",
            "studies (+experiment=NAME):",
            *(f"  {p.stem:<{width}}  {described(p)}" for p in studies),
            "",
            "config groups (group=option):",
            *(f"  {d.name}: {', '.join(sorted(p.stem for p in d.glob('*.yaml')))}" for d in groups),
            "  size: tiny, cpu, gpu (a study's size; unset: cpu without CUDA, else gpu)",
            "",
            "examples:",
            *(f"  {command:<{example_width}}  # {what}" for command, what in EXAMPLES),
            "",
            "The full configuration, every key with its value: python -m testbed [overrides] --cfg job",
            "(--cfg hydra for Hydra's own, --hydra-help for its flags). Every key: docs/configuration.md.",
        ]
    )


def main() -> None:
    """Hydra composes the command line's config and runs the job (Hydra and the config load here)."""
    import hydra

    from testbed.config import CONF_DIR, register_configs

    register_configs()  # again after cli(): the store replaces its one base_config
    hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")(job)()


def job(cfg: DictConfig, config: Config | None = None) -> None:
    """The task: `config` where the command line was composed and checked once already."""
    from hydra.core.hydra_config import HydraConfig

    from testbed.config import to_config
    from testbed.errors import TestbedError
    from testbed.studies.runner import interrupted_note, run_job

    hydra_cfg = HydraConfig.get()
    out_dir = Path(cfg.output_dir or hydra_cfg.runtime.output_dir)
    try:
        config = config or to_config(cfg)
        subdir = hydra_cfg.output_subdir  # None under torchrun's other ranks: they keep no record
        record_decided(config.decided, Path(hydra_cfg.runtime.output_dir) / subdir if subdir else None)
        run_job(config, out_dir)
    except TestbedError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(error.exit_code)
    except KeyboardInterrupt as stop:
        print(f"interrupted: {interrupted_note(cfg.experiment.name, out_dir, stop)}", file=sys.stderr)
        sys.exit(130)


def record_decided(decided: dict[str, Decided], hydra_dir: Path | None) -> None:
    """Print what the configuration chose for itself and keep it beside Hydra's record
    (`.hydra/decided.yaml`), so what ran is what the record says."""
    if not decided:
        return
    print("decided: " + ", ".join(f"{key}={d.value} ({d.why})" for key, d in decided.items()))
    if hydra_dir is not None and hydra_dir.is_dir():
        lines = [f"{key}: {json.dumps(d.value)}  # {d.why}" for key, d in decided.items()]
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

    from testbed.errors import TestbedError
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


def shows_job(argv: list[str]) -> bool:
    """`--cfg job` (or `-c job`, `--cfg=job`) of one job: the configuration that runs, printed by
    job_config; a multirun's, `--cfg hydra` and `--cfg all` stay Hydra's."""
    pairs = zip(argv, argv[1:] + [""])
    asked = "--cfg=job" in argv or any(a in ("--cfg", "-c") and b == "job" for a, b in pairs)
    return asked and not any(a in ("-m", "--multirun", "-p", "--package") for a in argv)


def job_config(argv: list[str]) -> str:
    """The resolved configuration with the study's own experiment keys, and its grid of points
    (testbed/studies/dry_run.py job_text), composed once from the command line's overrides."""
    from testbed.config import compose_config

    overrides = [a for a in argv if "=" in a and not a.startswith("-") and not a.startswith("hydra.")]
    return shown_job(compose_config(overrides))


def shown_job(config: Config) -> str:
    """What `--cfg job` prints for `config`: its study's keys and grid (testbed/studies/dry_run.py)."""
    from testbed.studies import dry_run
    from testbed.studies.catalog import study

    return dry_run.job_text(study(config.experiment.name), config)


def cli() -> None:
    if any(a in HELP_FLAGS for a in sys.argv[1:]):
        print(usage())
        return
    from testbed.composed import composes_once
    from testbed.config import register_configs
    from testbed.stopping import StopOnce

    register_configs()  # the structured configs every compose below validates against
    StopOnce().install()  # SIGINT/SIGTERM: workers stopped, finished requests and points kept; later signals wait
    argv = quiet_rank_args(sys.argv[1:])
    try:
        if composes_once(argv):
            once(argv)
        else:
            by_hydra(argv)
    finally:
        StopOnce.settle()


def once(argv: list[str]) -> None:
    """One job, or `--cfg job`: the command line composed once (testbed/composed.py), sized,
    checked, then shown or run."""
    from testbed.composed import compose_once, compose_with_hydra, hydra_context, run_composed, said
    from testbed.errors import TestbedError

    with hydra_context():
        try:
            composed = compose_once(argv, compose_with_hydra)
            said(composed.sizing)
            if shows_job(argv):
                print(shown_job(composed.config), end="")
                return
        except TestbedError as error:  # a grid the study cannot lay out here (no placement fits, ...) too
            print(f"error: {error}", file=sys.stderr)
            sys.exit(2)
        run_composed(composed.node, lambda cfg: job(cfg, composed.config))


def by_hydra(argv: list[str]) -> None:
    """A multirun, `--cfg hydra`, `--info` and Hydra's other flags: `@hydra.main`, after the size
    and the checks (each composes the command line)."""
    from testbed.config import check_overrides

    sys.argv[1:] = with_size(argv)
    problem = check_overrides(sys.argv[1:])
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
    main()


if __name__ == "__main__":
    cli()
