"""Mixture-of-Experts in the analytical cost model: the experts a step reads, their FLOPs, their weights.

A MoE layer's MLP is a router (hidden x num_experts, kept 16-bit and whole on every rank, as vLLM's
ReplicatedLinear gate), `num_shared_experts` SwiGLU experts every token passes, and `num_experts`
routed SwiGLU experts of width f (expert_intermediate_size), `experts_per_token` (k) of them per
token. A step runs the routed experts as one grouped GEMM (vLLM's fused_moe): tokens x k rows of
FLOPs, and each expert that at least one token chose has its weights read once.

Routing assumption: uniform and independent. Each token picks k distinct experts of E, every set of k
alike, whatever the other tokens picked. One token then misses a given expert with probability
C(E-1, k) / C(E, k) = 1 - k/E, and T tokens with (1 - k/E)^T, so a layer's step touches in
expectation

    E x (1 - (1 - k/E)^T)   distinct experts, per layer:

k at T = 1 (a one-sequence decode reads k experts' weights), all E as T grows (a prefill reads them
all). A real router is skewed and a prompt's tokens correlate; for the same per-expert shares the
sum of 1 - (1 - p_i)^T is concave in the shares, so uniform routing is the most experts (and bytes)
a step of T tokens can touch: an upper bound on the experts' traffic.

Tensor parallelism: vLLM's default shards every expert over the group (gate/up by columns, down by
rows), so each rank holds and reads 1/tp of each expert, ceil(f / tp) of its width, and runs every
routed row.

Expert parallelism (`expert_parallel`, vLLM's --enable-expert-parallel over the tensor-parallel
group, no data parallelism): each rank holds E/tp whole experts (the same bytes as the shards) and
reads, in expectation under the same routing, (E/tp) x (1 - (1 - k/E)^T) of them; attention stays
tensor-parallel, so every rank has every token and no all-to-all moves them: each runs the rows
routed to its experts and the group's all-reduce combines the outputs, as it does for sharded
experts. What differs is the balance: a rank's rows are Binomial(T x k, 1/tp) (each row lands on a
rank's experts with probability 1/tp), and the step waits for the busiest rank, in expectation

    T k / tp + z(tp) x sqrt(T k (1/tp)(1 - 1/tp)),   z(n) = Phi^-1((n - 0.375) / (n + 0.25))

(the normal approximation with Blom's expected maximum of n standard normals: z(2) = 0.59, z(8) =
1.43). A decode of one sequence puts its k rows on at most k ranks; a large prefill evens out.
Shared experts stay sharded (a dense MLP every token passes). Data-parallel attention with an
all-to-all dispatch of tokens to experts (wide EP) is not modelled.
"""

from __future__ import annotations

import math
from statistics import NormalDist
from typing import Protocol

from testbed.model.config import ModelArgs
from testbed.perf.gpus import Gpu


def expected_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Distinct experts `tokens` tokens touch in one layer, in expectation (uniform routing)."""
    if not tokens:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def busiest_rows(rows: int, ranks: int) -> float:
    """The rows the busiest of `ranks` expert-parallel ranks runs, in expectation: each of `rows`
    routed rows on a rank with probability 1/ranks (normal approximation, Blom's expected maximum),
    never fewer than an even share rounded up, never more than all of them."""
    if ranks == 1 or not rows:
        return float(rows)
    share = 1.0 / ranks
    z = NormalDist().inv_cdf((ranks - 0.375) / (ranks + 0.25))
    spread = rows * share + z * math.sqrt(rows * share * (1.0 - share))
    return min(float(rows), max(spread, float(math.ceil(rows * share))))  # some rank runs its even share


def expert_shard(a: ModelArgs, tp: int = 1) -> int:
    """One rank's width of every expert: expert_intermediate_size / tp, rounded up."""
    return -(-a.expert_width // tp)


def moe_layer_params(a: ModelArgs, tp: int = 1) -> int:
    """One rank's MLP parameters of one MoE layer: its shard of every routed and shared expert
    (gate, up and down: 3 x hidden x width each) and the whole router."""
    return (a.num_experts + a.num_shared_experts) * 3 * a.hidden_size * expert_shard(
        a, tp
    ) + a.hidden_size * a.num_experts


class Gemms(Protocol):
    """What the MoE terms ask of the roofline (testbed.perf.roofline.RooflineModel)."""

    gpu: Gpu
    model_args: ModelArgs
    tp: int
    dtype_bytes: int
    expert_parallel: bool

    def gemm(self, tokens: int, k: int, n: int, out_bytes: int = 0, weight_bytes=None, dtype=None) -> float: ...

    def roofline(self, flops: float, nbytes: float, mfu: float, dtype=None) -> float: ...


def moe_mlp(model: Gemms, tokens: int, weight_bytes: float, dtype: str) -> float:
    """One MoE layer's MLP over `tokens` tokens on one rank: the router, the shared experts (dense
    GEMMs over every token) and the routed experts' grouped GEMMs (gate/up, then down)."""
    a = model.model_args
    h, f = a.hidden_size, expert_shard(a, model.tp)
    time = model.gemm(tokens, h, a.num_experts)  # the router: 16-bit weights, the 16-bit peak
    if a.num_shared_experts:
        s = a.num_shared_experts * f
        time += model.gemm(tokens, h, 2 * s, weight_bytes=weight_bytes, dtype=dtype)
        time += model.gemm(tokens, s, h, weight_bytes=weight_bytes, dtype=dtype)
    routed = a.expert_width if model.expert_parallel else f  # whole experts, or every expert's shard
    time += routed_gemm(model, tokens, h, 2 * routed, weight_bytes, dtype)
    return time + routed_gemm(model, tokens, routed, h, weight_bytes, dtype)


def routed_gemm(model: Gemms, tokens: int, k: int, n: int, weight_bytes: float, dtype: str) -> float:
    """The routed experts' grouped (k x n) GEMM: tokens x top_k rows, each touched expert's
    weights read once, each row's activations in and out; under expert parallelism the busiest
    rank's rows over its E/tp experts."""
    a = model.model_args
    rows, db = tokens * a.experts_per_token, model.dtype_bytes
    touched = expected_experts(a.num_experts, a.experts_per_token, tokens)
    if model.expert_parallel:
        rows, touched = busiest_rows(rows, model.tp), touched / model.tp
    nbytes = touched * k * n * weight_bytes + rows * k * db + rows * n * db
    return model.roofline(2.0 * rows * k * n, nbytes, model.gpu.matmul_mfu, dtype)
