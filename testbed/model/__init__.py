"""Llama-family model, presets, attention backends and weight loading."""

from testbed.model.config import PRESETS, ModelArgs, ModelConfig
from testbed.model.llama import Transformer
from testbed.model.loader import build_model, resolve_dtype

__all__ = ["PRESETS", "ModelArgs", "ModelConfig", "Transformer", "build_model", "resolve_dtype"]
