"""Where worker processes come from: a fork server that imported torch and the worker once, so a
study's points start their workers in a fraction of a second each instead of importing torch anew;
spawn where the platform has no fork server. Imports no torch: a run starts the server before it
imports torch itself, and the two imports take a core each."""

from __future__ import annotations

import multiprocessing as mp
import sys
from multiprocessing import forkserver

PRELOAD = ["testbed.cluster.worker"]
COMMAND = "testbed.__main__"  # what the `testbed` command's script imports


def worker_context():
    """The multiprocessing context every point's workers start from."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD + ([COMMAND] if main_is_a_script() else []))
    return ctx


def main_is_a_script() -> bool:
    """A script's main (the `testbed` command, not `python -m testbed`) runs again in every worker
    forked from the server: Python's fork server never imports it first (the path it is handed is
    under a key its preload does not read). Imported once in the server, the command's module
    makes that rerun cheap: without it each worker spent 0.4 s importing Hydra and the config, and
    a 16-point sweep by the `testbed` command took 21.7 s against 12.8 s by `python -m testbed`.
    (testbed/__main__.py now imports those only when a job runs, so its rerun costs little either way.)"""
    main = sys.modules.get("__main__")
    return getattr(main, "__spec__", None) is None and getattr(main, "__file__", None) is not None


def start() -> None:
    """Start the fork server now, in the background (once a process; a no-op after). A real run
    calls it as soon as its config is valid: the server's imports (1.8 s of CPU on this machine)
    then run beside the run's own, not before its first workers."""
    if worker_context().get_start_method() == "forkserver":
        forkserver.ensure_running()
