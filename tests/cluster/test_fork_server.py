"""Where workers come from (testbed/cluster/fork_server.py): the fork server imports what a
worker needs once, and a script's main (the `testbed` command) is not imported again from scratch
in every worker it forks."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.paths import ROOT

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="no fork server on Windows")

# a main of its own: starts the server as a run does, forks one worker, says what the worker found
SCRIPT = """
import sys
from testbed.cluster.fork_server import main_is_a_script, start, worker_context

def found(queue):
    queue.put(sorted(m for m in ("hydra", "testbed.config", "testbed.__main__", "torch") if m in sys.modules))

if __name__ == "__main__":
    start()
    ctx = worker_context()
    queue = ctx.Queue()
    worker = ctx.Process(target=found, args=(queue,))
    worker.start()
    print(main_is_a_script(), queue.get(timeout=120))
    worker.join()
"""


def run_main(*command: str, path: str = "") -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (path, str(ROOT)) if p)}
    done = subprocess.run([sys.executable, *command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip()


def test_a_script_mains_workers_find_the_command_and_torch_imported_in_the_server(tmp_path):
    script = tmp_path / "main.py"
    script.write_text(SCRIPT)
    # the command's module imports no Hydra or config of its own (they load when a job runs)
    assert run_main(str(script)) == "True ['testbed.__main__', 'torch']"


def test_a_module_mains_workers_find_torch_but_not_the_command(tmp_path):
    """A `python -m` main (`python -m testbed`) is not run again from scratch: nothing of the
    command is preloaded."""
    (tmp_path / "probe.py").write_text(SCRIPT)
    assert run_main("-m", "probe", path=str(tmp_path)) == "False ['torch']"
