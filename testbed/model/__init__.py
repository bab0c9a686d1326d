"""Llama-family model, presets, attention backends and weight loading."""

from testbed.model.config import PRESETS, ModelArgs, ModelConfig

__all__ = ["PRESETS", "ModelArgs", "ModelConfig", "Transformer", "build_model", "resolve_dtype"]


def __getattr__(name: str):
    # the model and its loader pull in torch (seconds); configs and the simulator need neither
    if name == "Transformer":
        from testbed.model.llama import Transformer

        return Transformer
    if name in ("build_model", "resolve_dtype"):
        from testbed.model import loader

        return getattr(loader, name)
    raise AttributeError(f"module 'testbed.model' has no attribute {name!r}")
