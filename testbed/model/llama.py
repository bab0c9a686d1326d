"""A Llama-family decoder (Llama 3, Qwen2, Mixtral): RMSNorm, RoPE, grouped-query attention, SwiGLU
(or, with experts, Mixtral's sparse MoE: testbed/model/moe.py).

Read top to bottom. T = tokens packed across the batch, H = query heads, Hkv = KV heads,
D = head dim. `forward` runs on the paged KV pool; `dense_forward` recomputes one sequence
with no cache and is the reference the tests hold the paged path to.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from testbed.model.attention import AttentionMetadata, write_kv
from testbed.model.config import ModelArgs
from testbed.model.moe import SparseMoE
from testbed.model.ops import TorchOps
from testbed.model.rope import Llama3RopeScaling


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, ops=TorchOps) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


class Rotary(nn.Module):
    """RoPE in the Hugging Face layout (rotate the two halves), so real checkpoints load as they are.
    cos and sin of every position up to max_len are computed once, as transformers computes them
    per step, and looked up by position (one gather a step, inside a captured CUDA graph too)."""

    def __init__(self, head_dim: int, theta: float, max_len: int, scaling: Llama3RopeScaling | None = None):
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        if scaling is not None:
            inv_freq = llama3_inv_freq(inv_freq, scaling)
        self.inv_freq = inv_freq  # plain attributes: model.to(bfloat16) must not round them
        freqs = torch.arange(max_len).float()[:, None] * inv_freq[None, :]  # (max_len, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (max_len, D)
        self.cos_sin = torch.stack((emb.cos(), emb.sin()))  # (2, max_len, D)

    def forward(self, positions: torch.Tensor, ops=TorchOps):
        return ops.rope(self.cos_sin, positions)  # what ops.rotary takes: (cos, sin), each (T, D), for torch


def llama3_inv_freq(inv_freq: torch.Tensor, s: Llama3RopeScaling) -> torch.Tensor:
    """Llama 3.1 scaling, in transformers' float32 order of operations so frequencies match bit for
    bit: long wavelengths divided by `factor`, short ones kept, the band between interpolated."""
    low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


class Attention(nn.Module):
    """q, k and v come from one fused projection (rows: H x D of q, then Hkv x D of k, then of v;
    `checkpoint_tensors` names the slices), and q and k are rotated together."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        qkv_rows = (args.num_heads + 2 * args.num_kv_heads) * args.head_dim
        self.qkv_proj = nn.Linear(args.hidden_size, qkv_rows, bias=args.qkv_bias)
        self.o_proj = nn.Linear(args.num_heads * args.head_dim, args.hidden_size, bias=False)

    def forward(self, x, rope, kv_cache=None, meta: AttentionMetadata | None = None, backend=None, ops=TorchOps):
        T, H, Hkv, D = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)  # (T, (H + 2 Hkv) D)
        qk = ops.rotary(qkv[:, : (H + Hkv) * D].view(T, H + Hkv, D), rope)
        q, k = qk[:, :H], qk[:, H:]  # (T, H, D), (T, Hkv, D)
        v = qkv[:, (H + Hkv) * D :].view(T, Hkv, D)
        if meta is None:  # dense reference: one sequence, plain causal attention, no cache
            o = F.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
            ).transpose(0, 1)
        else:
            k_cache, v_cache = kv_cache  # each (num_blocks, block_size, Hkv, D)
            write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
            o = backend(q, k_cache, v_cache, meta, k=k, v=v)
        return self.o_proj(o.reshape(T, -1))


class MLP(nn.Module):
    """SwiGLU with gate and up fused into one projection (rows: gate, then up)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate_up_proj = nn.Linear(args.hidden_size, 2 * args.intermediate_size, bias=False)
        self.down_proj = nn.Linear(args.intermediate_size, args.hidden_size, bias=False)

    def forward(self, x, ops=TorchOps):
        return self.down_proj(ops.silu_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        if args.is_moe:
            self.block_sparse_moe = SparseMoE(args)  # Mixtral's name for the layer's MLP
        else:
            self.mlp = MLP(args)

    @property
    def feed_forward(self) -> nn.Module:
        return self.block_sparse_moe if hasattr(self, "block_sparse_moe") else self.mlp

    def forward(self, x, rope, kv_cache=None, meta=None, backend=None):
        ops = TorchOps if backend is None else backend.ops  # the dense reference: always torch
        x = x + self.self_attn(self.input_layernorm(x, ops), rope, kv_cache, meta, backend, ops)
        return x + self.feed_forward(self.post_attention_layernorm(x, ops), ops)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = Rotary(args.head_dim, args.rope_theta, args.max_model_len, args.rope_scaling)

    def forward(
        self, input_ids, positions, kv_caches, meta: AttentionMetadata, backend, after_layer=None
    ) -> torch.Tensor:
        """input_ids, positions: (T,) -> hidden (T, hidden); kv_caches[i] = (k, v) of layer i.
        `after_layer(i)` runs once layer i's KV is in the pool (layer-wise KV streaming)."""
        x = self.embed_tokens(input_ids)
        rope = self.rotary(positions, backend.ops)
        for i, (layer, kv) in enumerate(zip(self.layers, kv_caches)):
            x = layer(x, rope, kv, meta, backend)
            if after_layer is not None:
                after_layer(i)
        return self.norm(x, backend.ops)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()  # (N, vocab)

    @torch.inference_mode()
    def dense_forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        """(T,) -> logits (T, vocab): full recompute of one sequence, no KV cache."""
        if len(token_ids) > self.rotary.cos_sin.shape[1]:
            raise ValueError(
                f"{len(token_ids)} tokens exceed the {self.rotary.cos_sin.shape[1]} positions RoPE "
                "was built for (model.max_model_len)"
            )
        x = self.embed_tokens(token_ids)
        rope = self.rotary(torch.arange(len(token_ids), device=token_ids.device))
        for layer in self.layers:
            x = layer(x, rope)
        return self.logits(self.norm(x))


# checkpoint tensors that are row slices of one fused parameter here, in row order
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"), "w13": ("w1", "w3")}


def checkpoint_tensors(model: Transformer) -> dict[str, torch.Tensor]:
    """Each tensor a Hugging Face Llama / Qwen2 / Mixtral checkpoint holds, by its name there less the "model."
    prefix ("layers.0.self_attn.q_proj.weight"), as a view of this model's parameters: q, k and v
    are row slices of qkv_proj, gate and up of gate_up_proj (an expert's w1 and w3 of w13). A tied
    lm_head is not listed."""
    a = model.args
    rows = {
        "q_proj": a.num_heads * a.head_dim,
        "k_proj": a.num_kv_heads * a.head_dim,
        "v_proj": a.num_kv_heads * a.head_dim,
        "gate_proj": a.intermediate_size,
        "up_proj": a.intermediate_size,
        "w1": a.expert_width,
        "w3": a.expert_width,
    }
    tensors = {}
    for name, p in model.named_parameters():  # each shared parameter once: a tied head is the embedding
        *prefix, module, kind = name.split(".")
        if module not in FUSED:
            tensors[name] = p
            continue
        for shard, chunk in zip(FUSED[module], p.split([rows[s] for s in FUSED[module]])):
            tensors[".".join([*prefix, shard, kind])] = chunk
    return tensors


@torch.no_grad()
def init_dummy_weights(model: Transformer, seed: int, head_scale: float = 4.0) -> None:
    """Seeded random weights whose greedy choices are well separated: residual branches are
    scaled down so activations stay O(1), and the output head is scaled up so the top logit
    stands clear of the runner-up (token comparisons across batch shapes are then meaningful).
    Each checkpoint tensor is drawn from a seed of its own name, fused or not."""
    args = model.args
    for name, p in checkpoint_tensors(model).items():
        gen = torch.Generator(device=p.device).manual_seed(seed + hash_name(name))
        if name.endswith("norm.weight") or "layernorm" in name:
            p.fill_(1.0)
        elif name.endswith("bias"):
            p.copy_(torch.randn(p.shape, generator=gen, device=p.device, dtype=p.dtype) * 0.02)
        elif "embed_tokens" in name:
            p.copy_(torch.randn(p.shape, generator=gen, device=p.device, dtype=p.dtype))
        else:
            std = 1.0 / math.sqrt(p.shape[1])
            if name.endswith(("o_proj.weight", "down_proj.weight", "w2.weight")):
                std /= math.sqrt(2 * args.num_layers)
            if name == "lm_head.weight":
                std *= head_scale
            p.copy_(torch.randn(p.shape, generator=gen, device=p.device, dtype=p.dtype) * std)


def hash_name(name: str) -> int:
    """A stable per-tensor seed offset (Python's hash() is salted per process)."""
    return sum((i + 1) * ord(c) for i, c in enumerate(name)) % 1_000_003
