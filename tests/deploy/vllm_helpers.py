"""What the vLLM tests share: the interpreter that runs vLLM (TESTBED_VLLM_PYTHON, else this one),
skipping with a reason where it has no vLLM, and the scan for instance processes left behind."""

import os
import socket
import sys
from pathlib import Path

import pytest

from testbed.deploy.deployment import MARKER
from testbed.errors import ConfigError


def vllm_python() -> str:
    """The interpreter with vLLM, or the test is skipped saying why."""
    from testbed.deploy.install import check_install

    python = os.environ.get("TESTBED_VLLM_PYTHON", sys.executable)
    try:
        check_install(python, needs_nixl=True)
    except ConfigError as error:
        pytest.skip(f"no vLLM to test: {error}")
    return python


def processes_of(owner: int) -> list[int]:
    """Live processes whose environment carries the instance marker of driver process `owner`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:  # gone, or not ours to read
            continue
        if any(e.startswith(f"{MARKER}={owner}:".encode()) for e in environ):
            found.append(int(entry.name))
    return found


def port_free(port: int) -> bool:
    """Nothing listens on the port any more (connections it served may linger in TIME_WAIT, as after
    any server: SO_REUSEADDR binds past those, never past a listener)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True
