"""RoPE settings of a Hugging Face config.json, in either layout transformers has written.

Current transformers keeps everything under `rope_parameters` ({"rope_type", "rope_theta",
scaling keys}); older files have a top-level `rope_theta` and an optional `rope_scaling` dict
whose type is under "rope_type" or, older still, "type". Reading only one layout silently falls
back to the default theta, which changes every output token, so both are read here and any
RoPE variant the model does not implement is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from testbed.errors import ConfigError

DEFAULT_THETA = 10000.0
ROPE_TYPES = ("default", "llama3")


@dataclass(frozen=True)
class Llama3RopeScaling:
    """Llama 3.1 / 3.2 frequency scaling: wavelengths above original_max / low_freq_factor are
    stretched by `factor`, those below original_max / high_freq_factor are kept, and the band
    between is interpolated."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def validate(self) -> "Llama3RopeScaling":
        if self.factor <= 0 or self.low_freq_factor <= 0 or self.original_max_position_embeddings <= 0:
            raise ConfigError(
                f"llama3 rope scaling needs factor, low_freq_factor and "
                f"original_max_position_embeddings > 0 (got {self})"
            )
        if self.high_freq_factor <= self.low_freq_factor:
            raise ConfigError(
                f"llama3 rope scaling needs high_freq_factor > low_freq_factor "
                f"(got {self.high_freq_factor} and {self.low_freq_factor})"
            )
        return self


def read_rope(hf: dict, source: str) -> tuple[float, Optional[Llama3RopeScaling]]:
    """(theta, llama3 scaling or None) from a parsed config.json; `source` names the file in errors."""
    params = hf.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
            raise ConfigError(
                f"{source}: rope_parameters={params!r} is not one flat dict (per-layer RoPE is not supported)"
            )
        theta = params.get("rope_theta", hf.get("rope_theta", DEFAULT_THETA))
    else:
        params = hf.get("rope_scaling") or {}
        if not isinstance(params, dict):
            raise ConfigError(f"{source}: rope_scaling={params!r} is not a dict")
        theta = hf.get("rope_theta", DEFAULT_THETA)
    _refuse_partial_rotary(hf, params, source)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"{source}: rope_type={rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    if rope_type == "default":
        return float(theta), None
    return float(theta), _llama3(params, hf, source)


def _llama3(params: dict, hf: dict, source: str) -> Llama3RopeScaling:
    try:
        return Llama3RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            # transformers falls back to max_position_embeddings when the key is absent
            original_max_position_embeddings=int(
                params.get("original_max_position_embeddings", hf.get("max_position_embeddings", 0))
            ),
        ).validate()
    except KeyError as missing:
        raise ConfigError(f"{source}: rope_type 'llama3' needs key {missing} in its RoPE parameters") from None


def _refuse_partial_rotary(hf: dict, params: dict, source: str) -> None:
    factor = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if factor != 1.0:
        raise ConfigError(f"{source}: partial_rotary_factor={factor} is not supported (RoPE over the whole head only)")
