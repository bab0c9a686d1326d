"""The model's elementwise steps, two ways with one interface: TorchOps in torch calls (any device
and dtype; the reference, and what the dense forward always uses) and CpuOps in the C kernels of
testbed/model/cpu_ops.py (float32 on CPU, one call each where torch takes several). The attention
backend carries the set the paged forward uses (`backend.ops`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from testbed.model import cpu_ops


class TorchOps:
    name = "torch"

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # in float32 and in this order, as transformers' LlamaRMSNorm
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight

    @staticmethod
    def rope(table: torch.Tensor, positions: torch.Tensor):
        """What `rotary` takes, looked up once per forward: cos and sin (T, D) of each position."""
        cos, sin = table[:, positions]
        return cos, sin

    @staticmethod
    def rotary(x: torch.Tensor, rope) -> torch.Tensor:
        # x: (T, heads, D); the two halves rotated (the Hugging Face layout)
        cos, sin = rope
        x1, x2 = x.float().chunk(2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
        return (x.float() * cos[:, None] + rotated * sin[:, None]).to(x.dtype)

    @staticmethod
    def silu_mul(x: torch.Tensor) -> torch.Tensor:
        # (T, 2 I) of gate then up -> (T, I)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class CpuOps(TorchOps):
    name = "cpu"

    @staticmethod
    def rms_norm(x, weight, eps):
        return cpu_ops.rms_norm(x, weight, eps)

    @staticmethod
    def rope(table, positions):
        return table, positions  # the kernel looks positions up itself

    @staticmethod
    def rotary(x, rope):
        table, positions = rope
        return cpu_ops.rotary(x, positions, table)

    @staticmethod
    def silu_mul(x):
        return cpu_ops.silu_mul(x)
