"""Linear layers on CPU through oneDNN, the weight reordered once into its blocked layout.

torch's `F.linear` on CPU calls the BLAS it was built with (MKL), which on some CPUs takes a slow
generic path: on a two-core AMD EPYC, float32, one thread, oneDNN's packed GEMM (which torch
ships for its own CPU compiler) ran the small preset's projections 1.6-1.8x faster at 32 rows (a
decode step) and 1.6-2.3x at 4096 (a batch's prefill), within float32 rounding of a float64
product as MKL is (`python -m testbed.bench.engine_speed --linear`).

`pack_linears(model)` swaps every nn.Linear of a CPU model for a PackedLinear holding the same
Parameters (tied embeddings stay tied); the packed copy is made at the swap and again whenever
the weight changes in place (`_version`), so loading or editing weights after the swap is safe.
The packed copy is a second copy of each swapped weight in memory.
Elsewhere (CUDA, other dtypes, a build without oneDNN) nothing changes.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

# oneDNN spends about 10 us a call before any arithmetic (small preset, one thread): on the tiny
# preset's 64-wide weights it lost to MKL at 32 rows (18 us against 9) and won only at thousands;
# on 512-wide ones it won from 4 rows (1.4x at 4, 1.6-1.8x at 32) and lost at 1 and 2 (0.6-0.9x).
# Either path rounds differently in the last float32 bits, as BLAS kernels of different row
# counts already do.
MIN_PACKED_WEIGHT = 512 * 512
MIN_PACKED_ROWS = 4


def packed_dtypes() -> tuple[torch.dtype, ...]:
    """float32, and bfloat16 where this CPU has oneDNN's bfloat16 kernels (else it would emulate them)."""
    bf16 = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return (torch.float32, torch.bfloat16) if bf16 is not None and bf16() else (torch.float32,)


def available() -> bool:
    """oneDNN's packed linear is in this torch build."""
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class PackedLinear(nn.Linear):
    """nn.Linear whose forward runs oneDNN's GEMM on a packed copy of the weight."""

    packed: Optional[torch.Tensor] = None
    packed_version: int = -1

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "PackedLinear":
        packed = _sharing(cls, linear)
        packed._packed()  # now, so the copy's memory is taken before a KV pool is sized from what is left
        return packed

    def _packed(self) -> torch.Tensor:
        version = _version(self.weight)
        if self.packed is None or self.packed_version != version:
            with torch.no_grad():
                self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach().contiguous(), 1)
            self.packed_version = version
        return self.packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])  # (N, in)
        if (
            rows.shape[0] < MIN_PACKED_ROWS
            or x.dtype != self.weight.dtype
            or x.device.type != "cpu"
            or (torch.is_grad_enabled() and self.weight.requires_grad)
        ):
            return super().forward(x)  # a row or two, autograd, or a dtype not packed for: torch's path
        out = torch.ops.mkldnn._linear_pointwise(rows, self._packed(), self.bias, "none", [], "")  # (N, out)
        return out.view(*x.shape[:-1], self.out_features)


def _sharing(cls, linear: nn.Linear) -> nn.Linear:
    """A `cls` (nn.Linear or PackedLinear) on `linear`'s own Parameters: tied weights stay tied."""
    new = cls.__new__(cls)
    nn.Module.__init__(new)
    new.in_features, new.out_features = linear.in_features, linear.out_features
    new.weight, new.bias = linear.weight, linear.bias
    return new


def _version(t: torch.Tensor) -> int:
    # an inference tensor (loaded under inference_mode) keeps no counter: it is packed once
    return 0 if t.is_inference() else t._version


def _swap(model: nn.Module, swap) -> int:
    """Replace each child module for which `swap(child)` gives a module; how many were replaced."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if (new := swap(child)) is not None:
                setattr(parent, name, new)
                swapped += 1
    return swapped


def pack_linears(model: nn.Module) -> int:
    """Swap the model's nn.Linear modules for PackedLinear where it pays (CPU, float32 or bfloat16,
    a weight of MIN_PACKED_WEIGHT or more, oneDNN in this build); returns how many were swapped."""
    if not available():
        return 0
    dtypes = packed_dtypes()

    def packed(child):
        w = getattr(child, "weight", None)
        if type(child) is nn.Linear and w.device.type == "cpu" and w.dtype in dtypes and w.numel() >= MIN_PACKED_WEIGHT:
            return PackedLinear.from_linear(child)
        return None

    return _swap(model, packed)


def unpack_linears(model: nn.Module) -> int:
    """The inverse of pack_linears: torch's linear again, on the same Parameters (a benchmark's
    same-GEMM comparison); returns how many were swapped back."""

    def plain(child):
        return _sharing(nn.Linear, child) if isinstance(child, PackedLinear) else None

    return _swap(model, plain)
