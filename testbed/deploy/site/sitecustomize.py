"""Loaded by every Python process of a vLLM instance the testbed starts on CPU (its PYTHONPATH
holds this folder). Two settings vLLM and NIXL do not expose, each changed only where its variable
is set, and nothing else:

- TESTBED_VLLM_KV_CORES: vLLM's NixlConnector on CPU pins each worker's main thread, which is also
  its OpenMP master thread, to the last core of each NUMA node, so two instances on a one-node
  machine would compute on one core. The reservation becomes the instance's own cores.
- TESTBED_NIXL_PROGRESS_DELAY_US: NIXL's progress thread polls with no pause between passes
  (`pthrDelay = 0`), which takes about half of a one-core instance on CPU. The pause becomes this
  many microseconds: a transfer waits at most that much longer for its next poll.
"""

import importlib.abc
import importlib.machinery
import os
import sys

_CORES = os.environ.get("TESTBED_VLLM_KV_CORES")
_DELAY = os.environ.get("TESTBED_NIXL_PROGRESS_DELAY_US")


def _own_cores(cls):
    return [[int(c) for c in _CORES.split(",") if c.strip().isdigit()]]


def _patch_cpu_platform(module):
    platform = getattr(module, "CpuPlatform", None)
    if platform is not None and hasattr(platform, "discover_numa_topology"):
        platform.discover_numa_topology = classmethod(_own_cores)


class _Bindings:
    """NIXL's bindings module as its agent sees it, with the progress thread's pause set."""

    def __init__(self, real, delay_us):
        self._real, self._delay_us = real, delay_us

    def __getattr__(self, name):
        return getattr(self._real, name)

    def nixlAgent(self, name, config):  # noqa: N802 (the binding's own name)
        config.pthrDelay = self._delay_us
        return self._real.nixlAgent(name, config)


def _patch_nixl_api(module):
    real = getattr(module, "nixlBind", None)
    if real is not None and _DELAY.isdigit():
        module.nixlBind = _Bindings(real, int(_DELAY))


def _wanted(name):
    if _CORES and name == "vllm.platforms.cpu":
        return _patch_cpu_platform
    if _DELAY and name.endswith("._api") and name.split(".")[0].startswith("nixl"):
        return _patch_nixl_api
    return None


class _Patch(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        patch = _wanted(name)
        if patch is None:
            return None
        sys.meta_path.remove(self)  # find the real module, then wrap its loader
        try:
            spec = importlib.machinery.PathFinder.find_spec(name, path)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _Wrapped(spec.loader, patch)
        return spec


class _Wrapped(importlib.abc.Loader):
    def __init__(self, loader, patch):
        self.loader, self.patch = loader, patch

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        self.patch(module)


if _CORES or _DELAY:
    sys.meta_path.insert(0, _Patch())
