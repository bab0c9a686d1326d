"""The simulator's speed against another revision: python -m testbed.bench.sim_speed --against REV

Runs two commands through the CLI, each on this checkout and on REV (a `git worktree` of it in a
temporary directory, removed afterwards), interleaved round by round on the same machine, and
prints each one's wall and CPU time and the ratios REV s / this s measured within each round:

- `sim`: 100,000 requests over 64 simulated workers (16 P + 48 D, the tiny model's CPU profile);
- `plan`: the plan study of Llama-3-70B on 8 simulated H100s over tensor-parallel degrees 1-8.

A shared machine's load moves a single wall time by tens of percent, and the ratio of two runs
minutes apart with it: the CPU time (user + system) moves less, and the load average printed beside
each round says how busy the machine was. Run more --rounds on a busy machine.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

COMMANDS = {
    "sim": [
        "executor=sim",
        "mode=disagg",
        "hardware=cpu",
        "model=tiny",
        "cluster.num_prefill=16",
        "cluster.num_decode=48",
        "hardware.num_devices=64",
        "workload=poisson",
        "workload.num_requests={requests}",
        "workload.rate=2000",
    ],
    "plan": [
        "+experiment=plan",
        "executor=sim",
        "model=llama3_70b",
        "hardware.num_devices=8",
        "sim.profile=h100_sxm",
        "experiment.own.tp_degrees=[1,2,4,8]",
    ],
}


def command(name: str, requests: int, out: Path) -> list[str]:
    overrides = [o.format(requests=requests) for o in COMMANDS[name]]
    return [sys.executable, "-m", "testbed", *overrides, f"hydra.run.dir={out}", "tracker=none"]


def timed(cmd: list[str], cwd: Path, log: Path) -> tuple[float, float]:
    """(wall, CPU) seconds of `cmd` run in `cwd` (its `testbed` package first on the path); CPU:
    user + system of the command and its children, which a busy machine moves less than the wall."""
    env = {**os.environ, "PYTHONPATH": str(cwd)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    with log.open("w") as stream:
        code = subprocess.run(cmd, cwd=cwd, env=env, stdout=stream, stderr=subprocess.STDOUT).returncode
    seconds = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if code:
        raise SystemExit(f"{' '.join(cmd)} failed in {cwd} (exit {code}); its output: {log}")
    return seconds, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def which_testbed(cwd: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(cwd)}
    probe = [sys.executable, "-c", "import testbed, pathlib; print(pathlib.Path(testbed.__file__).parent.parent)"]
    return subprocess.run(probe, cwd=cwd, env=env, capture_output=True, text=True, check=True).stdout.strip()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--against", required=True, help="the git revision to compare with (e.g. HEAD~3)")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of old, new (alternating which goes first)")
    parser.add_argument("--only", choices=sorted(COMMANDS), action="append", help="one command (repeatable)")
    parser.add_argument("--requests", type=int, default=100_000, help="the sim command's requests")
    a = parser.parse_args(argv)
    names = a.only or list(COMMANDS)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a stopped benchmark removes its worktree too
    scratch = Path(tempfile.mkdtemp(prefix="sim_speed_"))
    old = scratch / "old"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(old), a.against], check=True)
    try:
        found = which_testbed(old)
        if Path(found) != old:
            raise SystemExit(f"the old checkout's runs would import testbed from {found}, not {old}")
        print(f"old: {a.against} ({old}); new: this checkout ({ROOT}); {os.cpu_count()} CPUs", flush=True)
        ratios: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
        for r in range(a.rounds):
            for name in names:
                order = [("old", old), ("new", ROOT)] if r % 2 == 0 else [("new", ROOT), ("old", old)]
                wall, cpu, loads = {}, {}, []
                for which, cwd in order:
                    loads.append(os.getloadavg()[0])
                    out = scratch / f"{name}_{which}_{r}"
                    log = scratch / f"{name}_{which}_{r}.log"
                    wall[which], cpu[which] = timed(command(name, a.requests, out), cwd, log)
                    shutil.rmtree(out, ignore_errors=True)
                ratio = (wall["old"] / wall["new"], cpu["old"] / cpu["new"])
                ratios[name].append(ratio)
                print(
                    f"round {r + 1} {name}: wall old {wall['old']:.1f} s, new {wall['new']:.1f} s, old/new "
                    f"{ratio[0]:.2f}; CPU old {cpu['old']:.1f} s, new {cpu['new']:.1f} s, old/new {ratio[1]:.2f} "
                    f"(load average at the starts: {', '.join(f'{x:.1f}' for x in loads)})",
                    flush=True,
                )
        for name, values in ratios.items():
            walls, cpus = zip(*values)
            print(
                f"{name}: old/new median wall {statistics.median(walls):.2f}, "
                f"CPU {statistics.median(cpus):.2f} over {len(values)} round(s)"
            )
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)], check=False)
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
