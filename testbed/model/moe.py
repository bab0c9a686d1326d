"""A Mixture-of-Experts MLP, as Mixtral's sparse block: a router scores every expert for each token,
the top k run (SwiGLU each), and their outputs are summed with the router's renormalised weights.

T = tokens packed across the batch, E = experts, k = experts per token, I = one expert's width.
Names follow Mixtral's checkpoints (`block_sparse_moe.gate`, `experts.N.w1/w2/w3`), so a checkpoint
transformers writes loads by name (testbed/model/loader.py); w1 (gate) and w3 (up) are one fused
projection here, as the dense MLP's gate and up are.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from testbed.model.config import ModelArgs
from testbed.model.ops import TorchOps


class Expert(nn.Module):
    """One SwiGLU expert: w13 = w1 (gate) rows, then w3 (up) rows; w2 projects back."""

    def __init__(self, hidden_size: int, width: int):
        super().__init__()
        self.w13 = nn.Linear(hidden_size, 2 * width, bias=False)
        self.w2 = nn.Linear(width, hidden_size, bias=False)

    def forward(self, x, ops=TorchOps):
        return self.w2(ops.silu_mul(self.w13(x)))


class SparseMoE(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k = args.experts_per_token
        self.gate = nn.Linear(args.hidden_size, args.num_experts, bias=False)  # the router
        self.experts = nn.ModuleList(Expert(args.hidden_size, args.expert_width) for _ in range(args.num_experts))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, hidden) -> each token's k experts (T, k) and their weights (T, k, float32, summing to 1)."""
        probs = F.softmax(self.gate(x).float(), dim=-1)  # (T, E)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        return chosen, weights / weights.sum(dim=-1, keepdim=True)

    def forward(self, x, ops=TorchOps):
        """(T, hidden) -> (T, hidden): each expert runs once, on the tokens that chose it."""
        chosen, weights = self.route(x)
        out = torch.zeros_like(x)
        for expert in chosen.unique().tolist():
            tokens, slot = (chosen == expert).nonzero(as_tuple=True)
            y = self.experts[expert](x[tokens], ops) * weights[tokens, slot, None]
            out.index_add_(0, tokens, y.to(x.dtype))
        return out
