"""Where worker processes come from: a fork server that imported torch and the worker once, so a
study's points start their workers in a fraction of a second each instead of importing torch anew;
spawn where the platform has no fork server. Imports no torch: a run starts the server before it
imports torch itself, and the two imports take a core each."""

from __future__ import annotations

import multiprocessing as mp
from multiprocessing import forkserver

PRELOAD = ["testbed.cluster.worker"]


def worker_context():
    """The multiprocessing context every point's workers start from."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def start() -> None:
    """Start the fork server now, in the background (once a process; a no-op after). A real run
    calls it as soon as its config is valid: the server's imports (1.8 s of CPU on this machine)
    then run beside the run's own, not before its first workers."""
    if worker_context().get_start_method() == "forkserver":
        forkserver.ensure_running()
