"""python -m testbed.serve_http [http.port=8000] [any override of python -m testbed]

The testbed's engine (one worker, or a whole cluster in any mode) behind an OpenAI-compatible
`/v1/completions`, for `executor=http` and for other benchmark clients. Ctrl-C or SIGTERM stops
it; the run's results directory (as seen from the server) is written on the way out.
"""

import sys
from pathlib import Path
from typing import Optional

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from testbed.cluster import fork_server
from testbed.composed import compose_once, compose_with_hydra, hydra_context, only_overrides, run_composed
from testbed.config import CONF_DIR, Config, check_overrides, register_configs, to_config
from testbed.errors import ConfigError, TestbedError
from testbed.experiment import ONE_POINT
from testbed.net.rendezvous import torchrun_world
from testbed.stopping import StopOnce

register_configs()


def serve(cfg: DictConfig, config: Optional[Config] = None) -> None:
    """The task: `config` where the command line was composed and checked once already."""
    out_dir = Path(cfg.output_dir or HydraConfig.get().runtime.output_dir)
    try:
        config = config or to_config(cfg)
        if config.experiment.name != ONE_POINT:
            raise ConfigError(
                f"experiment={config.experiment.name}: the server runs one serving configuration; "
                f"drop +experiment (studies replay against it with executor=http)"
            )
        if torchrun_world() is not None:
            raise ConfigError(
                "the HTTP server runs its workers on one box; across hosts run "
                "torchrun ... -m testbed (README, Across hosts)"
            )
        fork_server.start()  # the workers' imports beside the server's own
        from testbed.server.app import HttpServer  # after Hydra and the fork server: keeps `--help` fast

        tokenizer = load_tokenizer(config.http.tokenizer or config.model.path)
        with HttpServer(config, out_dir, **tokenizer) as server:
            STOP.first = lambda: None  # serving: the first signal ends the wait below, nothing is raised
            if not STOP.requested.is_set():  # one that came while starting up stops it here
                print(
                    f"serving mode={config.mode} model={config.model.name} on {server.url}/v1/completions "
                    f"(Ctrl-C stops; results go to {out_dir})",
                    flush=True,
                )
            while not STOP.requested.wait(timeout=1.0):
                pass
        print(f"stopped; the requests served are in {out_dir}", file=sys.stderr)
    except TestbedError as error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(error.exit_code)
    except KeyboardInterrupt:
        print(f"stopped; the requests served are in {out_dir}", file=sys.stderr)


def load_tokenizer(path) -> dict:
    """Text in and out when the model directory has a tokenizer; token ids alone otherwise."""
    from testbed.http.prompts import find_tokenizer

    tokenizer = find_tokenizer(path)
    if tokenizer is None:
        return {}
    return {"text": tokenizer.decode, "encode": lambda text: tokenizer.encode(text, add_special_tokens=False)}


# SIGINT or SIGTERM: open requests failed, workers stopped, results written once; later signals are
# ignored until that is done. Before the server serves, the first one interrupts the start.
STOP = StopOnce()

main = hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")(serve)


def once(argv: list[str]) -> None:
    """Overrides only: composed and checked once (testbed/composed.py), then served."""
    with hydra_context():
        try:
            composed = compose_once(argv, compose_with_hydra, sized=False)
        except TestbedError as error:
            print(f"error: {error}", file=sys.stderr)
            sys.exit(2)
        run_composed(composed.node, lambda cfg: serve(cfg, composed.config))


def by_hydra(argv: list[str]) -> None:
    """Hydra's flags (`--cfg`, `--info`, ...): `@hydra.main`, after the checks."""
    problem = check_overrides(argv)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
    main()


if __name__ == "__main__":
    STOP.install()
    try:
        once(sys.argv[1:]) if only_overrides(sys.argv[1:]) else by_hydra(sys.argv[1:])
    finally:
        STOP.settle()
