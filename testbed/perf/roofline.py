"""The analytical cost model: a per-component roofline of one engine step on a named GPU.

Each component is its own roofline, max(FLOPs / (peak x mfu), bytes / (HBM x share)), and the
step is their sum plus the engine's per-step overhead (BLIS lesson 4, per component; lesson 2,
the overhead). A step runs the linear layers once over all its tokens, then attention for the
prefill chunks and for the decodes (lesson 5: a mixed step is additive):

- GEMMs, per layer: qkv (fused), o, gate/up (fused), down over every token of the batch; each
  reads its weights once per step, plus its activations.
- elementwise, per layer: RMSNorms, RoPE, SiLU x up, residual adds: memory-bound activations.
- prefill attention: 4 x tokens x attended keys x heads x head_dim FLOPs (QK^T and PV).
- decode attention: reads `decode_context` tokens of K and V per layer.
- lm_head: one row of logits per sampling sequence (a decode, or the chunk that ends a prompt).

The engine's host side, stated apart from the kernels (`host_terms`):
- the per-step host time, scheduling, sampling and detokenising outside the kernels: a fixed part
  (`host_fixed_s`; unset, the GPU table's `step_overhead_s`) plus a part per sequence the step
  samples for (`host_per_seq_s`: each decode, and the chunk that ends a prompt);
- kernel launches: a decode step replayed from a CUDA graph launches once; with graphs off
  (`cuda_graphs=False`, vLLM's --enforce-eager) it launches KERNELS_PER_LAYER kernels a layer
  eagerly, and the GPU idles KERNEL_LAUNCH_S between them. Prefill steps run eagerly either way,
  their kernels long enough to hide the launches.

Mixture-of-Experts (model_args.num_experts > 0): the MLP of every layer is a router, shared experts
and the routed experts' grouped GEMMs, whose weights a step reads only for the experts its tokens
touch: E(1 - (1 - k/E)^tokens) of them under uniform routing (testbed/perf/moe.py, with the
assumption and how tensor and expert parallelism split them).

Precision apart from `dtype` (testbed/perf/precision.py): `weight_dtype="fp8"` holds the decoder
layers' weights in one byte and runs their GEMMs at the GPU's FP8 peak (the 16-bit peak on a GPU
without FP8 tensor cores); the embedding, lm_head, router and attention stay at `dtype`, and so do
the activations. `kv_dtype` (fp8: one byte) sizes K and V everywhere: the cache reads and writes of
attention, the pool, a hand-off's bytes (rank_kv_bytes_per_token).

Tensor parallelism (`tp` > 1): the step of one rank of a Megatron-style group of tp GPUs, which
every rank runs in lockstep. q/k/v and gate/up are column-parallel, o and down row-parallel, so each
rank's GEMMs hold 1/tp of the FLOPs and weights; attention runs num_heads / tp query heads over the
rank's KV heads (num_kv_heads / tp, or one head replicated on tp / num_kv_heads ranks: counted once
per rank); the norms and residuals stay whole on every rank. Two all-reduces a layer (after o and
after down) of tokens x hidden x dtype_bytes each, as a ring over NVLink:
2(tp-1)/tp x bytes / (NVLink x share) + 2(tp-1) x the hop latency. The embedding and lm_head are
split by vocabulary rows (vLLM's VocabParallelEmbedding and ParallelLMHead); their per-step
all-reduce and logits gather (one each a step, against two a layer) are not timed. tp=1 is the
one-device model, to the last bit.

The same interface as testbed.perf.measured.CostModel, so the simulator and a paced real
worker take either. No clock, no torch: pure arithmetic on the model shape. `dtype` picks the
peak (16-bit tensor cores for float16 and bfloat16, equal on these GPUs; FP32 for float32);
`dtype_bytes` scales the memory traffic.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from functools import cached_property
from typing import ClassVar, Iterable, NamedTuple, Optional

from testbed.model.config import ModelArgs
from testbed.perf.attention import attended_context
from testbed.perf.gpus import KERNEL_LAUNCH_S, Gpu
from testbed.perf.moe import expert_shard, moe_layer_params, moe_mlp
from testbed.perf.precision import element_bytes, is_fp8

FLASH_QUERY_TILE = 128  # flash-attn reads a chunk's cached keys once per tile of this many queries
# kernels of one decoder layer run eagerly: 2 RMSNorms, qkv, RoPE, the KV-cache write, attention,
# o, 2 residual adds, gate/up, SiLU x up, down, and the casts and copies between them
KERNELS_PER_LAYER = 14


class Shard(NamedTuple):
    """One rank's widths in a tensor-parallel group of tp (tp=1: the whole model's), in elements."""

    q: int  # query (and attention output) width: num_heads / tp x head_dim
    kv: int  # K (and V) width: the rank's KV heads x head_dim, a replicated head counted once
    inter: int  # MLP width: intermediate_size / tp
    vocab: int  # embedding and lm_head rows: vocab_size / tp, rounded up


def shard(a: ModelArgs, tp: int = 1) -> Shard:
    return Shard(
        a.num_heads // tp * a.head_dim,
        a.kv_heads_per_rank(tp) * a.head_dim,
        -(-a.intermediate_size // tp),
        -(-a.vocab_size // tp),
    )


@dataclass(frozen=True)
class RooflineModel:
    gpu: Gpu
    model_args: ModelArgs
    dtype_bytes: int = 2
    causal_attention: bool = True  # flash-attn on a GPU skips a chunk's masked half
    dtype: str = "bfloat16"  # the peak FLOPs (Gpu.flops_for); dtype_bytes the traffic
    host_fixed_s: Optional[float] = None  # per-step host time; None: the GPU table's step_overhead_s
    host_per_seq_s: float = 0.0  # more host time per sequence the step samples for
    cuda_graphs: bool = True  # decode steps replayed from CUDA graphs (False: eager launches)
    tp: int = 1  # tensor-parallel degree: the step of one rank of a group of tp GPUs
    # a MoE model's experts placed whole, E/tp a rank (vLLM's --enable-expert-parallel over the
    # group): the step waits for the busiest rank (testbed/perf/moe.py). False: every expert sharded
    expert_parallel: bool = False
    # a quantized checkpoint's bits per decoder-layer weight (GPTQ/AWQ int4: 4), dequantized in the
    # GEMM (compute at `dtype`); the embedding and lm_head stay at dtype_bytes, as vLLM loads them.
    # None: dtype_bytes
    weight_bits: Optional[int] = None
    weight_dtype: str = "auto"  # the decoder layers' weights (fp8: one byte, the FP8 peak); auto: dtype
    kv_dtype: str = "auto"  # the KV cache's elements (fp8, fp8_e4m3, fp8_e5m2: one byte); auto: dtype
    # the kv_transfer.backend values it times (both: the NVLink formula)
    transports: ClassVar[tuple] = ("process_group", "ipc")

    # -- the CostModel interface -------------------------------------------------------------------
    def prefill_context(self, chunks: Iterable[tuple[int, int]]) -> float:
        return attended_context(chunks, self.causal_attention)

    def step_time(self, prefill_tokens: int, prefill_context: float, decode_seqs: int, decode_context: int) -> float:
        return self.combine(self.breakdown(prefill_tokens, prefill_context, decode_seqs, decode_context))

    def combine(self, parts: dict[str, float]) -> float:
        """A step's time from its components: their sum (AsyncRoofline overlaps host and GPU)."""
        return sum(parts.values())

    def decode_times(self, decode_seqs: int, context: int, steps: int) -> list[float]:
        """step_time(0, 0.0, decode_seqs, context + decode_seqs x i) for i < steps, to the last bit:
        one breakdown, whose decode attention alone changes with the context (a decode run's steps)."""
        parts = self.breakdown(0, 0.0, decode_seqs, context)
        layers, combine = self.model_args.num_layers, self.combine
        q, kv, db, kvb = self.shard.q, self.shard.kv, self.dtype_bytes, self.kv_bytes
        gpu = self.gpu
        compute = gpu.flops_for(self.dtype) * gpu.attention_mfu  # decode_attention's roofline, inlined
        memory = gpu.hbm_bytes_per_s * gpu.hbm_share
        own = decode_seqs * (2 * q * db + 2 * kv * kvb)
        times = []
        for c in range(context, context + decode_seqs * steps, decode_seqs):
            parts["decode_attention"] = layers * max(4.0 * c * q / compute, (c * 2 * kv * kvb + own) / memory)
            times.append(combine(parts))
        return times

    def transfer_time(self, nbytes: int, backend: str = "process_group") -> float:
        """A KV send over NVLink (one direction). ipc (P's copy into D's pool over peer access)
        crosses the same link: a roofline does not tell the two apart."""
        return self.gpu.link_latency_s + nbytes / (self.gpu.nvlink_bytes_per_s * self.gpu.nvlink_share)

    def as_dict(self) -> dict:
        return {
            "kind": "analytical",
            "gpu": asdict(self.gpu),
            "dtype_bytes": self.dtype_bytes,
            "causal_attention": self.causal_attention,
            "dtype": self.dtype,
            "host": self.host_terms(),
            "tp": self.tp,
            "expert_parallel": self.expert_parallel,
            "weight_bits": self.weight_bits,
            "weight_dtype": self.weight_dtype,
            "kv_dtype": self.kv_dtype,
        }

    def host_terms(self) -> dict:
        """The stated host side: per-step fixed and per-sequence time, CUDA graphs, eager launch gap."""
        return {
            "fixed_s": self.host_fixed,
            "per_seq_s": self.host_per_seq_s,
            "cuda_graphs": self.cuda_graphs,
            "eager_decode_launch_s": self.eager_launch_s(),
        }

    @property
    def host_fixed(self) -> float:
        return self.gpu.step_overhead_s if self.host_fixed_s is None else self.host_fixed_s

    def eager_launch_s(self) -> float:
        """The launch gaps an eager decode step adds (0 with CUDA graphs)."""
        return 0.0 if self.cuda_graphs else self.model_args.num_layers * KERNELS_PER_LAYER * KERNEL_LAUNCH_S

    # -- the components ----------------------------------------------------------------------------
    def breakdown(
        self, prefill_tokens: int, prefill_context: float, decode_seqs: int, decode_context: int
    ) -> dict[str, float]:
        """Seconds per component of one step (their sum is `step_time`)."""
        layers = self.model_args.num_layers
        tokens = prefill_tokens + decode_seqs
        sampled = decode_seqs + (1 if prefill_tokens else 0)
        gemm, elementwise, all_reduce = self.token_terms(tokens)
        return {  # summed in this order: the simulator's times, to the last bit, depend on it
            "overhead": self.host_fixed,
            "host_per_seq": self.host_per_seq_s * sampled,
            "launch": self.eager_launch_s() if decode_seqs and not prefill_tokens else 0.0,
            "gemm": gemm,
            "elementwise": elementwise,
            "prefill_attention": layers * self.prefill_attention(prefill_tokens, prefill_context),
            "decode_attention": layers * self.decode_attention(decode_seqs, decode_context),
            "lm_head": self.lm_head(sampled),
            "all_reduce": all_reduce,
        }

    def token_terms(self, tokens: int) -> tuple[float, float, float]:
        """(GEMMs, elementwise, all-reduces) of a batch of `tokens`: set by the count alone, so
        remembered (a simulation asks for the same few hundred counts hundreds of thousands of
        times; at most the token budget's worth are ever kept)."""
        if tokens not in self._by_tokens:
            layers = self.model_args.num_layers
            self._by_tokens[tokens] = (
                layers * self.layer_gemms(tokens) if tokens else 0.0,
                self.elementwise(tokens),
                2 * layers * self.all_reduce(tokens),
            )
        return self._by_tokens[tokens]

    def lm_head(self, sampled: int) -> float:
        """The logits of the `sampled` sequences (remembered, as token_terms)."""
        if sampled not in self._by_sampled:
            a = self.model_args
            self._by_sampled[sampled] = (
                self.gemm(sampled, a.hidden_size, self.shard.vocab, out_bytes=4) if sampled else 0.0
            )
        return self._by_sampled[sampled]

    @cached_property
    def _by_tokens(self) -> dict:
        return {}

    @cached_property
    def _by_sampled(self) -> dict:
        return {}

    @cached_property
    def shard(self) -> Shard:
        """This rank's widths (cached: asked at every step)."""
        return shard(self.model_args, self.tp)

    def all_reduce(self, tokens: int) -> float:
        """One ring all-reduce of the group over the tokens' hidden states (0 on one device)."""
        if self.tp == 1 or not tokens:
            return 0.0
        gpu, steps = self.gpu, 2 * (self.tp - 1)
        nbytes = tokens * self.model_args.hidden_size * self.dtype_bytes
        return steps / self.tp * nbytes / (gpu.nvlink_bytes_per_s * gpu.nvlink_share) + steps * gpu.nvlink_hop_latency_s

    def roofline(self, flops: float, nbytes: float, mfu: float, dtype: Optional[str] = None) -> float:
        """max(compute, memory) at the peak of `dtype` (None: the model's)."""
        gpu = self.gpu
        peak = gpu.flops_for(dtype or self.dtype)
        return max(flops / (peak * mfu), nbytes / (gpu.hbm_bytes_per_s * gpu.hbm_share))

    @property
    def layer_weight_bytes(self) -> float:
        """Bytes per decoder-layer weight: the quantized width, else weight_dtype's, else the dtype's."""
        if self.weight_bits is not None:
            return self.weight_bits / 8
        return element_bytes(self.weight_dtype, self.dtype_bytes)

    @property
    def gemm_dtype(self) -> str:
        """The peak the decoder layers' GEMMs run at: FP8 weights on FP8 tensor cores, else dtype's."""
        return "fp8" if is_fp8(self.weight_dtype) else self.dtype

    @property
    def kv_bytes(self) -> int:
        """Bytes per K or V element in the cache."""
        return element_bytes(self.kv_dtype, self.dtype_bytes)

    def gemm(
        self,
        tokens: int,
        k: int,
        n: int,
        out_bytes: int = 0,
        weight_bytes: Optional[float] = None,
        dtype: Optional[str] = None,
    ) -> float:
        """(tokens x k) @ (k x n): weights read once, activations in and out."""
        db = self.dtype_bytes
        weights = k * n * (db if weight_bytes is None else weight_bytes)
        nbytes = weights + tokens * k * db + tokens * n * (out_bytes or db)
        return self.roofline(2.0 * tokens * k * n, nbytes, self.gpu.matmul_mfu, dtype)

    def layer_gemms(self, tokens: int) -> float:
        """Column-parallel qkv and gate/up, row-parallel o and down: each rank's shard of the weights;
        a MoE layer's MLP as testbed/perf/moe.py."""
        q, kv, inter, _ = self.shard
        h, wb, dt = self.model_args.hidden_size, self.layer_weight_bytes, self.gemm_dtype
        attention = self.gemm(tokens, h, q + 2 * kv, weight_bytes=wb, dtype=dt) + self.gemm(
            tokens, q, h, weight_bytes=wb, dtype=dt
        )
        if self.model_args.is_moe:
            return attention + moe_mlp(self, tokens, wb, dt)
        return (
            attention
            + self.gemm(tokens, h, 2 * inter, weight_bytes=wb, dtype=dt)
            + self.gemm(tokens, inter, h, weight_bytes=wb, dtype=dt)
        )

    @cached_property
    def mlp_width(self) -> int:
        """One token's MLP width on this rank: the dense intermediate, or its experts' (k routed and
        the shared ones)."""
        a = self.model_args
        if not a.is_moe:
            return self.shard.inter
        return (a.experts_per_token + a.num_shared_experts) * expert_shard(a, self.tp)

    def elementwise(self, tokens: int) -> float:
        """Norms, RoPE, SiLU x up, residual adds: elements read + written per token per layer,
        plus the embedding gather and the final norm. Norms and residuals run whole on every rank."""
        a = self.model_args
        q, kv = self.shard.q, self.shard.kv
        per_layer = 10 * a.hidden_size + 2 * (q + kv) + 3 * self.mlp_width
        elements = tokens * (a.num_layers * per_layer + 3 * a.hidden_size)
        return self.roofline(0.0, elements * self.dtype_bytes, 1.0)

    def prefill_attention(self, tokens: int, context: float) -> float:
        """One layer: FLOPs of the attended pairs; bytes of Q, O, the new K/V, and the cached
        keys each query tile reads."""
        if not tokens:
            return 0.0
        q, kv, db, kvb = self.shard.q, self.shard.kv, self.dtype_bytes, self.kv_bytes
        tiles = max(1.0, tokens / FLASH_QUERY_TILE)
        nbytes = tokens * (2 * q * db + 2 * kv * kvb) + tiles * context * 2 * kv * kvb
        return self.roofline(4.0 * tokens * context * q, nbytes, self.gpu.attention_mfu)

    def decode_attention(self, seqs: int, context: int) -> float:
        """One layer: every decode reads its whole K and V; writes its own new K/V."""
        if not seqs:
            return 0.0
        q, kv, db, kvb = self.shard.q, self.shard.kv, self.dtype_bytes, self.kv_bytes
        nbytes = context * 2 * kv * kvb + seqs * (2 * q * db + 2 * kv * kvb)
        return self.roofline(4.0 * context * q, nbytes, self.gpu.attention_mfu)

    # -- memory (per device: one rank's) ------------------------------------------------------
    @property
    def vocab_params(self) -> int:
        """One rank's embedding and lm_head rows (one table when tied)."""
        a = self.model_args
        return self.shard.vocab * a.hidden_size * (1 if a.tie_embeddings else 2)

    @property
    def weight_bytes(self) -> int:
        layers = rank_params(self.model_args, self.tp) - self.vocab_params
        return int(layers * self.layer_weight_bytes + self.vocab_params * self.dtype_bytes)

    def weight_read_s(self) -> float:
        """Reading every streamed weight once at the achievable bandwidth: a memory-bound step's
        floor. The input embedding is gathered row by row, not streamed (unless tied to lm_head)."""
        a = self.model_args
        gathered = 0 if a.tie_embeddings else self.shard.vocab * a.hidden_size
        return self.roofline(0.0, self.weight_bytes - gathered * self.dtype_bytes, 1.0)

    def kv_pool_bytes(self, memory_utilization: float) -> float:
        """The KV pool as vLLM sizes it: the utilised share of the device memory, less the weights."""
        return self.gpu.memory_bytes * memory_utilization - self.weight_bytes

    @property
    def rank_kv_bytes_per_token(self) -> int:
        """K and V of every layer for one token on one rank: its KV heads, a replicated one whole.
        The group's pool holds as many tokens as one rank's pool does."""
        return 2 * self.model_args.num_layers * self.shard.kv * self.kv_bytes

    def holds_one_sequence(self, memory_utilization: float) -> bool:
        """The weights and the KV of one max_model_len sequence fit each device of the group."""
        return self.kv_pool_bytes(memory_utilization) >= self.model_args.max_model_len * self.rank_kv_bytes_per_token


def weight_params(a: ModelArgs) -> int:
    """Parameters of a Llama-family model (embedding, layers, final norm, lm_head unless tied)."""
    return rank_params(a, 1)


def rank_params(a: ModelArgs, tp: int = 1) -> int:
    """Parameters one rank of a tensor-parallel group holds: its shard of every linear layer (KV
    heads replicated where fewer than ranks), its vocabulary rows of the embedding and lm_head, and
    the norms whole; a MoE layer's experts and router as testbed/perf/moe.py."""
    q, kv, inter, vocab = shard(a, tp)
    mlp = moe_layer_params(a, tp) if a.is_moe else 3 * a.hidden_size * inter
    per_layer = a.hidden_size * (q + 2 * kv) + q * a.hidden_size + mlp
    per_layer += 2 * a.hidden_size + (q + 2 * kv if a.qkv_bias else 0)
    embeddings = vocab * a.hidden_size * (1 if a.tie_embeddings else 2)
    return embeddings + a.num_layers * per_layer + a.hidden_size
