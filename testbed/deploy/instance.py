"""One `vllm serve` process: its command line and environment, its start (ports free, readiness by
/health, the log kept), and its end by its process group on every path out.

An instance is started in a session of its own (`start_new_session`), so ending it ends every
process it forked (vLLM's engine core and workers) by one `killpg`; `Instance.stop` sends SIGTERM,
waits `stop_timeout_s`, then SIGKILL. Every instance of a process is also in `LIVE`, which an
`atexit` hook and the deployment's context manager drain, so no path out leaves a server behind."""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from testbed.errors import TestbedError

HEALTH_POLL_S = 0.5  # how often a starting instance's /health is asked
GROUP_POLL_S = 0.05  # how often a stopped instance's process group is looked for
LOG_TAIL_LINES = 5  # an instance that failed to start: its last log lines in the error


class InstanceFailed(TestbedError):
    """An instance that did not start or died: its last log lines, in one line."""

    exit_code = 1


@dataclass(frozen=True)
class InstanceSpec:
    """What one instance runs: `argv` after the interpreter, `env` on top of this process's."""

    name: str  # p0, d0, m1 (prefill, decode, mixed) : the log's name
    role: str  # mixed | prefill | decode
    port: int
    argv: tuple  # the words after the interpreter: -m vllm.entrypoints.openai.api_server ...
    env: dict = field(default_factory=dict)
    cpus: tuple = ()  # CPU: every process of the instance on these cores (its server and engine core too)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def shell_line(self, python: str) -> str:
        """The command a user can paste to start this instance by hand."""
        env = " ".join(f"{k}={_quoted(v)}" for k, v in sorted(self.env.items()))
        pin = f"taskset -c {','.join(map(str, self.cpus))} " if self.cpus else ""
        return f"{env} {pin}{python} " + " ".join(_quoted(a) for a in self.argv)


class Instance:
    def __init__(self, spec: InstanceSpec, python: str, log_path: Path):
        self.spec, self.python, self.log_path = spec, python, log_path
        self.process: Optional[subprocess.Popen] = None

    def start(self) -> "Instance":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"$ {self.spec.shell_line(self.python)}\n".encode())
            log.flush()
            self.process = subprocess.Popen(
                [self.python, *self.spec.argv],
                env={**os.environ, **self.spec.env},
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own process group: one killpg ends what it forked
                preexec_fn=self._pin if self.spec.cpus else None,
            )
        LIVE.add(self)
        return self

    def _pin(self) -> None:
        """In the child before exec: the instance and all it forks on its own cores."""
        os.sched_setaffinity(0, self.spec.cpus)

    @property
    def pid(self) -> Optional[int]:
        return self.process.pid if self.process is not None else None

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def healthy(self, timeout_s: float = 2.0) -> bool:
        try:
            with urllib.request.urlopen(self.spec.url + "/health", timeout=timeout_s) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def wait_ready(self, deadline: float, others: tuple = ()) -> None:
        """Until /health answers 200; InstanceFailed when it (or one of `others`, starting beside
        it) exits first, or at `deadline` (time.monotonic)."""
        while not self.healthy():
            for instance in (self, *others):
                if not instance.alive():
                    raise InstanceFailed(instance.failure("exited while starting"))
            if time.monotonic() > deadline:
                raise InstanceFailed(self.failure("did not answer /health in vllm.start_timeout_s"))
            time.sleep(HEALTH_POLL_S)

    def failure(self, what: str) -> str:
        code = self.process.poll() if self.process is not None else None
        status = f" (exit status {code})" if code is not None else ""
        tail = " | ".join(log_tail(self.log_path, LOG_TAIL_LINES))
        return f"vLLM instance {self.spec.name} on port {self.spec.port} {what}{status}; log {self.log_path}: {tail}"

    def stop(self, timeout_s: float) -> None:
        """SIGTERM to its process group, SIGKILL after `timeout_s`; idempotent."""
        LIVE.discard(self)
        if self.process is None:
            return
        _signal_group(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pass
        _signal_group(self.process.pid, signal.SIGKILL)  # what it forked may outlive its leader
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:  # unkillable (uninterruptible sleep): said, not waited on forever
            pass
        # the leader reaped, what it forked may still be dying (reparented, SIGKILL not yet through): the
        # instance is stopped when no process of its group runs
        _await_group(self.process.pid, timeout_s)


def _await_group(pgid: int, timeout_s: float) -> None:
    """Until no process of group `pgid` runs (a zombie has ended), at most `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while _group_runs(pgid) and time.monotonic() < deadline:
        time.sleep(GROUP_POLL_S)


def _group_runs(pgid: int) -> bool:
    """A process of group `pgid` that is not a zombie (Linux: /proc; elsewhere: any member, a signal 0)."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):  # gone between the listing and the read
            continue
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return True
    return False


def _signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def log_tail(path: Path, lines: int) -> list[str]:
    """The last non-blank lines of a log (read from its end: a log may be large)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            text = f.read().decode(errors="replace")
    except OSError:
        return []
    kept = [line.strip() for line in text.splitlines() if line.strip()]
    return [line[:300] for line in kept[-lines:]]


def _quoted(word: str) -> str:
    plain = word and all(c.isalnum() or c in "-_./:=,@" for c in word)
    return word if plain else "'" + word.replace("'", "'\\''") + "'"


class _Live(set):
    """Every started instance not yet stopped, in this process."""

    def stop_all(self, timeout_s: float = 10.0) -> None:
        for instance in list(self):
            instance.stop(timeout_s)


LIVE = _Live()
atexit.register(LIVE.stop_all)
