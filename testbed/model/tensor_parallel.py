"""Megatron-style tensor parallelism of the Llama-family model: one rank's shard of a full model.

Each rank of a group of `tp` holds H/tp query heads and their KV heads (a KV head replicated on
tp/Hkv ranks when there are fewer KV heads than ranks, as vLLM does), the matching columns of the
q/k/v projection and rows of o_proj (column- then row-parallel), and 1/tp of the MLP's
intermediate width (gate/up column-parallel, down row-parallel). Two all-reduces a layer, after
o_proj and after down_proj, sum the ranks' partial outputs, so every rank holds the same hidden
state after each layer. The embedding, the norms and the LM head are replicated (the presets'
vocabularies fit one device at the shapes the engine runs here): every rank computes the same
logits and takes the same greedy token, so no sampled token crosses the group.

The group is a torch.distributed group (gloo on CPU, NCCL on GPUs); the engine on each rank runs
the same schedule on the same requests and sizes its KV pool from the shard's KV heads.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn

from testbed.model.config import ModelArgs
from testbed.model.llama import Transformer, checkpoint_tensors


def shard_args(args: ModelArgs, tp: int) -> ModelArgs:
    """The shape one rank runs: its query heads, its KV heads, its share of the MLP."""
    return replace(
        args,
        num_heads=args.num_heads // tp,
        num_kv_heads=args.kv_heads_per_rank(tp),
        intermediate_size=args.intermediate_size // tp,
        head_dim=args.head_dim,
    )


class AllReduced(nn.Module):
    """A row-parallel linear: each rank's partial product, summed over the group."""

    def __init__(self, linear: nn.Linear, group):
        super().__init__()
        self.linear, self.group = linear, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear(x)
        dist.all_reduce(out, group=self.group)
        return out


def shard_model(full: Transformer, rank: int, tp: int, group) -> Transformer:
    """Rank `rank`'s shard of `full` (any of its weights: dummy or a checkpoint's), its row-parallel
    projections all-reduced over `group`."""
    args = full.args
    shard = Transformer(shard_args(args, tp)).to(next(full.parameters()).dtype)
    source, target = checkpoint_tensors(full), checkpoint_tensors(shard)
    with torch.no_grad():
        for name, tensor in target.items():
            tensor.copy_(slice_of(name, source[name], args, rank, tp))
    for layer in shard.layers:
        layer.self_attn.o_proj = AllReduced(layer.self_attn.o_proj, group)
        layer.mlp.down_proj = AllReduced(layer.mlp.down_proj, group)
    return shard.eval().requires_grad_(False)


def slice_of(name: str, tensor: torch.Tensor, args: ModelArgs, rank: int, tp: int) -> torch.Tensor:
    """The rank's part of one checkpoint tensor: rows of the column-parallel projections, columns of
    the row-parallel ones, the rest whole."""
    D = args.head_dim
    heads = args.num_heads // tp
    kind = name.split(".")[-2] if "." in name else name
    if kind == "q_proj":  # (H D, hidden) rows, or its bias
        return tensor[rank * heads * D : (rank + 1) * heads * D]
    if kind in ("k_proj", "v_proj"):
        kv = args.kv_heads_of(rank, tp)
        return tensor[kv.start * D : kv.stop * D]
    if kind == "o_proj":  # (hidden, H D): the columns of the rank's heads
        return tensor[:, rank * heads * D : (rank + 1) * heads * D]
    width = args.intermediate_size // tp
    if kind in ("gate_proj", "up_proj"):
        return tensor[rank * width : (rank + 1) * width]
    if kind == "down_proj":
        return tensor[:, rank * width : (rank + 1) * width]
    return tensor  # embedding, norms, LM head: replicated


def check_shardable(args: ModelArgs, tp: int) -> None:
    """The degrees this shape splits into, or ValueError naming what does not divide."""
    if args.is_moe and tp > 1:
        raise ValueError(f"tp={tp}: the engine does not shard a Mixture-of-Experts model's experts")
    if tp < 1 or args.num_heads % tp or args.intermediate_size % tp:
        raise ValueError(
            f"tp={tp} must divide num_heads={args.num_heads} and intermediate_size={args.intermediate_size}"
        )
    if not args.splits_over(tp):  # the KV heads' rule, as the configuration checks it
        raise ValueError(f"tp={tp} and num_kv_heads={args.num_kv_heads}: one must divide the other")
