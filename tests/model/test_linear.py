"""The CPU's packed GEMM (testbed.model.linear): the same numbers as torch's linear to float32
rounding, the same Parameters (tied weights stay tied), a fresh packing after an in-place edit,
torch's path under autograd, and small weights left alone. Transformers' greedy tokens through
it: tests/model/test_loader.py's `wide` checkpoint."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from testbed.model import linear
from testbed.model.config import PRESETS
from testbed.model.llama import Transformer

pytestmark = pytest.mark.skipif(not linear.available(), reason="this torch build has no oneDNN linear")


def wide(bias: bool = False) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(512, 768, bias=bias)


@pytest.mark.parametrize("rows", [1, 7, 32, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_is_torch_linear_to_float32_rounding(rows, bias):
    plain = wide(bias)
    packed = linear.PackedLinear.from_linear(plain)
    x = torch.randn(rows, 512)
    exact = F.linear(x.double(), plain.weight.double(), None if plain.bias is None else plain.bias.double())
    with torch.inference_mode():
        ours, theirs = packed(x), plain(x)
    assert ours.shape == theirs.shape == (rows, 768)
    scale = exact.abs().max().item()
    assert (ours.double() - exact).abs().max().item() < 1e-5 * scale  # float32 accumulation over 512 terms
    assert (theirs.double() - exact).abs().max().item() < 1e-5 * scale
    with torch.inference_mode():
        assert packed(x.view(rows, 1, 512)).shape == (rows, 1, 768)  # leading dimensions kept


def test_an_in_place_edit_is_packed_again_and_autograd_takes_torchs_path():
    packed = linear.PackedLinear.from_linear(wide())
    x = torch.randn(4, 512)
    with torch.no_grad():
        before = packed(x)
        packed.weight.mul_(2.0)
        assert torch.allclose(packed(x), 2 * before, rtol=1e-5, atol=1e-5)
    packed(x).sum().backward()  # grad enabled: the plain linear, so gradients flow
    assert packed.weight.grad is not None and packed.weight.grad.shape == (768, 512)


def test_pack_linears_swaps_wide_weights_only_and_keeps_the_parameters():
    small = Transformer(PRESETS["small"])
    small.lm_head.weight = small.embed_tokens.weight  # tied, as a checkpoint with tie_word_embeddings
    names = {name: p for name, p in small.named_parameters()}
    swapped = linear.pack_linears(small)
    layer = small.layers[0]
    assert swapped == 8 * 4 + 1 and isinstance(layer.self_attn.qkv_proj, linear.PackedLinear)
    assert small.lm_head.weight is small.embed_tokens.weight  # still one tensor
    assert {name: p for name, p in small.named_parameters()} == names  # the same Parameters, same names
    assert linear.unpack_linears(small) == swapped and type(layer.self_attn.qkv_proj) is nn.Linear
    assert {name: p for name, p in small.named_parameters()} == names
    tiny = Transformer(PRESETS["tiny"])  # 64 wide: oneDNN's per-call cost outweighs its GEMM
    assert linear.pack_linears(tiny) == 0 and type(tiny.layers[0].mlp.down_proj) is nn.Linear
