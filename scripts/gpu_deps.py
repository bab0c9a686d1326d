"""The Python packages scripts/gpu_check needs on a GPU machine with no package registry, read from
pyproject.toml's dependencies (so a new dependency is checked without editing a list here), plus
what the checks themselves run (pytest) and what the code imports beyond the declared ones.

    python scripts/gpu_deps.py missing   pip names of the packages that do not import here, one line
    python scripts/gpu_deps.py carried   requirements scripts/gpu_wheels downloads into wheels/, one a line
    python scripts/gpu_deps.py stock     the packages assumed on the image (too large to carry), one line

Stdlib only: it runs before anything is installed.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
# pip name -> the module it installs, where the two differ
IMPORT_NAMES = {
    "hydra-core": "hydra",
    "nvidia-ml-py": "pynvml",
    "pyzmq": "zmq",
    "antlr4-python3-runtime": "antlr4",
    "pyyaml": "yaml",
}
# a PyTorch GPU image has these, and their wheels are too large to carry (tens of MB each)
STOCK = {"torch", "numpy", "pandas", "pyarrow", "matplotlib", "scipy"}
EXTRA = [
    "pytest>=7",  # runs the gpu-marked tests (the dev extra, which a stock image lacks)
    "antlr4-python3-runtime==4.9.*",  # omegaconf's parser runtime (hydra-core 1.3 pins 4.9)
]


def dependencies(text: str) -> list[str]:
    """[project].dependencies of a pyproject.toml (tomllib where there is one); none has a marker."""
    try:
        import tomllib

        return list(tomllib.loads(text)["project"]["dependencies"])
    except ModuleNotFoundError:  # Python 3.10: the array's quoted strings
        block = re.search(r"^dependencies\s*=\s*\[(.*?)^\]", text, re.S | re.M).group(1)
        return re.findall(r'^\s*"([^"]+)"', block, re.M)


def requirements() -> list[str]:
    return dependencies(PYPROJECT.read_text()) + EXTRA


def dist_name(requirement: str) -> str:
    return re.match(r"[A-Za-z0-9_.-]+", requirement).group(0).lower().replace("_", "-")


def module_name(requirement: str) -> str:
    name = dist_name(requirement)
    return IMPORT_NAMES.get(name, name.replace("-", "_"))


def missing() -> list[str]:
    return [dist_name(r) for r in requirements() if importlib.util.find_spec(module_name(r)) is None]


def carried() -> list[str]:
    """Requirements without their comments, the stock ones left out."""
    return [r.split(";")[0].strip() for r in requirements() if dist_name(r) not in STOCK]


def main(argv: list[str]) -> int:
    commands = {
        "missing": lambda: " ".join(missing()),
        "carried": lambda: "\n".join(carried()),
        "stock": lambda: " ".join(sorted(STOCK)),
    }
    if len(argv) != 1 or argv[0] not in commands:
        print(f"gpu_deps: unknown arguments {' '.join(argv)!r} (allowed: {', '.join(commands)})", file=sys.stderr)
        return 2
    print(commands[argv[0]]())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
