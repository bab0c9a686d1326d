"""Named GPUs for the analytical (roofline) cost model: datasheet peaks and achievable shares.

Peaks are datasheet figures; the efficiency factors turn them into what kernels reach. Each
number carries its source. Sources named here:
- [A100-DS] NVIDIA A100 Tensor Core GPU datasheet: bf16 312 TFLOP/s dense, fp16 the same; FP32
  (no tensor cores) 19.5 TFLOP/s; HBM 1,555 GB/s (40GB), 2,039 GB/s (80GB SXM); NVLink 600 GB/s both
  directions.
- [H100-DS] NVIDIA H100 datasheet, SXM5: bf16 1,979 TFLOP/s with 2:4 sparsity, so 989 dense, fp16
  the same; FP32 67 TFLOP/s; HBM3 3.35 TB/s; NVLink 900 GB/s both directions.
- [H200-DS] NVIDIA H200 datasheet, SXM: 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s, the H100's
  compute.
- [H100-FP8] the same datasheets (H100 SXM, H200 SXM): FP8 tensor core 3,958 TFLOP/s with 2:4
  sparsity, so 1,979 dense.
- [B200-DS] NVIDIA HGX B200 datasheet, per GPU (1,000 W): FP8 9 PFLOP/s and bf16 4.5 with sparsity,
  so 4.5 and 2.25 dense; FP32 80 TFLOP/s; 180 GB HBM3e (1,440 GB over 8) at 8 TB/s; NVLink 5
  1.8 TB/s both directions.
- [L40S-DS] NVIDIA L40S datasheet: bf16 362.05 TFLOP/s dense (733 with sparsity), FP8 733 dense
  (1,466 with sparsity), FP32 91.6; 48 GB GDDR6 at 864 GB/s; no NVLink: PCIe Gen4 x16, 64 GB/s
  both directions.
- [RTXPRO-DS] NVIDIA RTX PRO 6000 Blackwell (Workstation Edition) datasheet: 96 GB GDDR7 at
  1,792 GB/s, 4,000 AI TOPS (FP4 with sparsity), FP32 125 TFLOP/s, PCIe Gen5 x16 (128 GB/s both
  directions, no NVLink). Dense FP8 and bf16 halve FP4's sparse figure once for the sparsity and
  once per precision step: 1,000 and 500 TFLOP/s (188 SMs x 1,024 bf16 FLOP a clock x 2.6 GHz).
- [A10-DS] NVIDIA A10 Tensor Core GPU datasheet: fp16/bf16 125 TFLOP/s dense (250 with sparsity);
  FP32 31.2 TFLOP/s; 24 GB GDDR6 at 600 GB/s; no NVLink: PCIe Gen4 x16, 64 GB/s both directions.
- [NVSMI] total memory nvidia-smi reports: A100-SXM4-40GB 40,960 MiB; A100-SXM4-80GB 81,920 MiB;
  H100 80GB HBM3 81,559 MiB; H200 143,771 MiB.
- [BLIS] inference-sim roofline v2, lesson 1: achievable HBM bandwidth is about 0.8 of peak
  (STREAM sustains 2,650-2,750 of 3,350 GB/s on H100); InferSim multiplies HBM and NVLink by 0.8.
  Lesson 2: a per-step CPU overhead of milliseconds in Python engines (InferSim: 5 ms a decode step).
- [VIDUR] microsoft/vidur operator profiles (data/profiling/compute/{a100,h100}/...): cuBLAS bf16
  GEMMs of 7-8B shapes at 2K-8K tokens reach 0.70-0.74 of peak on A100 and 0.75-0.77 on H100;
  send_recv between two NVLink GPUs takes 4-17 us for small messages and moves ~350 GB/s at 64 MiB
  on H100 (0.77 of 450).
- [NCCL] NVIDIA/nccl#1264: H100 SXM p2pBandwidthLatencyTest ~380 of 450 GB/s one way (0.84).
- [LAUNCH] a CUDA kernel launch costs the host about 5 us (NVIDIA's CUDA Graphs introduction,
  "Getting Started with CUDA Graphs", 2019: 2-5 us per launch; a decode step of a 7-8B model runs
  about 14 kernels a layer, so eager decode leaves the GPU idle between short kernels that long).
- [NCCL-TUNE] NVIDIA/nccl src/graph/tuning.cc (2.19-2.21), the cost model NCCL picks algorithms by:
  a ring all-reduce on NVLink takes 2(n-1) steps of hwLat[NVLINK][RING][LL] = 0.6 us each (the
  low-latency protocol of small messages) on top of a base latency (6.6 us) that CUDA-graph
  replay and vLLM's custom all-reduce largely avoid.
- [FA2] Dao, FlashAttention-2 (2023): forward attention reaches up to ~70% of A100 peak at long
  sequences. [FA3] Shah et al., FlashAttention-3 (2024): FlashAttention-2 reaches ~35% of H100 peak.
"""

from __future__ import annotations

from dataclasses import dataclass

from testbed.errors import ConfigError

MIB = 2**20
NVLINK_HOP_LATENCY_S = 0.6e-6  # [NCCL-TUNE] one ring step on NVLink, LL protocol (A100 and H100 alike)


@dataclass(frozen=True)
class Gpu:
    """One device. Bandwidths in bytes/s, NVLink one direction; `*_share` and `*_mfu` in (0, 1]."""

    name: str
    peak_flops: float  # dense bf16/fp16 tensor-core FLOP/s (the two are equal on every GPU here)
    hbm_bytes_per_s: float
    nvlink_bytes_per_s: float
    memory_bytes: float
    matmul_mfu: float  # share of peak a GEMM reaches when compute-bound
    attention_mfu: float  # share of peak the attention kernel reaches when compute-bound
    hbm_share: float  # achievable share of the HBM bandwidth
    nvlink_share: float  # achievable share of the NVLink bandwidth (a KV send)
    step_overhead_s: float  # per-step CPU time of a Python engine outside kernels
    link_latency_s: float  # fixed cost of one KV send
    fp32_flops: float = 0.0  # dense FP32 FLOP/s without tensor cores (torch's default: TF32 matmuls off)
    fp8_flops: float = 0.0  # dense FP8 tensor-core FLOP/s; 0: no FP8 tensor cores (Ampere)
    # one step of a ring all-reduce over NVLink (a tensor-parallel group's), 2(tp-1) steps each
    nvlink_hop_latency_s: float = NVLINK_HOP_LATENCY_S

    def flops_for(self, dtype: str) -> float:
        """The peak a matmul of this dtype reaches: the 16-bit tensor-core peak for float16 and
        bfloat16 (equal on these GPUs), the FP32 peak for float32, the FP8 peak for fp8. A GPU
        without FP8 tensor cores runs an FP8 checkpoint weight-only (vLLM's Marlin kernel: the
        weights dequantized to 16 bits in the GEMM), so at the 16-bit peak."""
        if dtype in SIXTEEN_BIT:
            return self.peak_flops
        if dtype == "float32":
            return self.fp32_flops or self.peak_flops
        if dtype in FP8:
            return self.fp8_flops or self.peak_flops
        raise ConfigError(f"gpu {self.name}: no peak for dtype {dtype!r} (one of {', '.join(DTYPES)})")

    def validate(self) -> "Gpu":
        for key in ("matmul_mfu", "attention_mfu", "hbm_share", "nvlink_share"):
            if not 0 < getattr(self, key) <= 1:
                raise ConfigError(f"gpu {self.name}: {key}={getattr(self, key)} must be in (0, 1]")
        return self


# Shared factors. A Python engine's step overhead: 2 ms, the low end of [BLIS]'s "milliseconds"
# (InferSim's 5 ms is vLLM's, API server and detokenisation included, which this engine lacks).
HBM_SHARE = 0.8  # [BLIS]; [VIDUR] decode GEMVs of Llama shapes read weights at 0.75-0.78
NVLINK_SHARE = 0.8  # [BLIS] InferSim; [NCCL] 0.84; [VIDUR] 0.77
STEP_OVERHEAD_S = 2e-3  # [BLIS] lesson 2
LINK_LATENCY_S = 10e-6  # [VIDUR] small-message send_recv 4-17 us
KERNEL_LAUNCH_S = 5e-6  # [LAUNCH]
SIXTEEN_BIT = ("bfloat16", "float16", "auto")  # auto: what a CUDA engine loads a 16-bit checkpoint in
FP8 = ("fp8", "fp8_e4m3", "fp8_e5m2")  # vLLM's names (--quantization fp8, --kv-cache-dtype)
DTYPES = (*SIXTEEN_BIT, "float32", *FP8)

GPUS: dict[str, Gpu] = {
    "a10": Gpu(
        "NVIDIA A10",
        peak_flops=125e12,
        hbm_bytes_per_s=600e9,  # GDDR6 [A10-DS]
        nvlink_bytes_per_s=32e9,  # no NVLink: a KV send or an all-reduce crosses PCIe Gen4 x16, one direction
        memory_bytes=24 * 1024 * MIB,  # [A10-DS] 24 GB (nvidia-smi's figure not at hand)
        matmul_mfu=0.7,
        attention_mfu=0.5,  # as the A100 (Ampere too): no profile of the A10's kernels at hand
        hbm_share=HBM_SHARE,
        nvlink_share=NVLINK_SHARE,
        step_overhead_s=STEP_OVERHEAD_S,
        link_latency_s=LINK_LATENCY_S,
        fp32_flops=31.2e12,
    ),  # [A10-DS]
    "a100_40g": Gpu(
        "NVIDIA A100-SXM4-40GB",
        peak_flops=312e12,
        hbm_bytes_per_s=1555e9,  # [A100-DS]
        nvlink_bytes_per_s=300e9,
        memory_bytes=40960 * MIB,  # [A100-DS], [NVSMI]
        matmul_mfu=0.7,
        attention_mfu=0.5,  # [VIDUR] 0.70-0.74; [FA2] up to ~0.7, less at serving shapes
        hbm_share=HBM_SHARE,
        nvlink_share=NVLINK_SHARE,
        step_overhead_s=STEP_OVERHEAD_S,
        link_latency_s=LINK_LATENCY_S,
        fp32_flops=19.5e12,
    ),  # [A100-DS]
    "a100_80g": Gpu(
        "NVIDIA A100-SXM4-80GB",
        peak_flops=312e12,
        hbm_bytes_per_s=2039e9,  # [A100-DS]
        nvlink_bytes_per_s=300e9,
        memory_bytes=81920 * MIB,  # [A100-DS], [NVSMI]
        matmul_mfu=0.7,
        attention_mfu=0.5,  # as a100_40g
        hbm_share=HBM_SHARE,
        nvlink_share=NVLINK_SHARE,
        step_overhead_s=STEP_OVERHEAD_S,
        link_latency_s=LINK_LATENCY_S,
        fp32_flops=19.5e12,
    ),  # [A100-DS]
    "h100_sxm": Gpu(
        "NVIDIA H100 80GB HBM3 (SXM5)",
        peak_flops=989e12,
        hbm_bytes_per_s=3350e9,  # [H100-DS]
        nvlink_bytes_per_s=450e9,
        memory_bytes=81559 * MIB,  # [H100-DS], [NVSMI]
        matmul_mfu=0.75,
        attention_mfu=0.35,  # [VIDUR] 0.75-0.77; [FA3] FA2 on Hopper
        hbm_share=HBM_SHARE,
        nvlink_share=NVLINK_SHARE,
        step_overhead_s=STEP_OVERHEAD_S,
        link_latency_s=LINK_LATENCY_S,
        fp32_flops=67e12,
        fp8_flops=1979e12,  # [H100-FP8]
    ),  # [H100-DS]
    "h200": Gpu(
        "NVIDIA H200 (SXM)",
        peak_flops=989e12,
        hbm_bytes_per_s=4800e9,  # [H200-DS]
        nvlink_bytes_per_s=450e9,
        memory_bytes=143771 * MIB,  # [H200-DS], [NVSMI]
        matmul_mfu=0.75,
        attention_mfu=0.35,  # the H100's compute: as h100_sxm
        hbm_share=HBM_SHARE,
        nvlink_share=NVLINK_SHARE,
        step_overhead_s=STEP_OVERHEAD_S,
        link_latency_s=LINK_LATENCY_S,
        fp32_flops=67e12,
        fp8_flops=1979e12,  # [H100-FP8]
    ),  # the H100's compute
    "b200": Gpu(
        "NVIDIA B200",
        peak_flops=2250e12,
        hbm_bytes_per_s=8000e9,  # [B200-DS]
        nvlink_bytes_per_s=900e9,  # NVLink 5, one direction
        memory_bytes=180e9,  # [B200-DS] (nvidia-smi's figure not at hand)
        matmul_mfu=0.75,  # as h100_sxm: no profile of Blackwell's kernels at hand
        attention_mfu=0.35,  # as h100_sxm
        hbm_share=HBM_SHARE,
        nvlink_share=NVLINK_SHARE,
        step_overhead_s=STEP_OVERHEAD_S,
        link_latency_s=LINK_LATENCY_S,
        fp32_flops=80e12,
        fp8_flops=4500e12,
    ),  # [B200-DS]
    "l40s": Gpu(
        "NVIDIA L40S",
        peak_flops=362.05e12,
        hbm_bytes_per_s=864e9,  # GDDR6 [L40S-DS]
        nvlink_bytes_per_s=32e9,  # no NVLink: PCIe Gen4 x16, one direction (as a10)
        memory_bytes=48 * 1024 * MIB,  # [L40S-DS] 48 GB (nvidia-smi's figure not at hand)
        matmul_mfu=0.7,  # as a10: no profile of Ada's kernels at hand
        attention_mfu=0.5,  # as a10
        hbm_share=HBM_SHARE,
        nvlink_share=NVLINK_SHARE,
        step_overhead_s=STEP_OVERHEAD_S,
        link_latency_s=LINK_LATENCY_S,
        fp32_flops=91.6e12,
        fp8_flops=733e12,
    ),  # [L40S-DS]
    "rtx_pro_6000": Gpu(
        "NVIDIA RTX PRO 6000 Blackwell Workstation Edition",
        peak_flops=500e12,
        hbm_bytes_per_s=1792e9,  # GDDR7 [RTXPRO-DS]
        nvlink_bytes_per_s=64e9,  # no NVLink: PCIe Gen5 x16, one direction
        memory_bytes=96 * 1024 * MIB,  # [RTXPRO-DS] 96 GB (nvidia-smi's figure not at hand)
        matmul_mfu=0.7,  # as l40s
        attention_mfu=0.5,  # as l40s
        hbm_share=HBM_SHARE,
        nvlink_share=NVLINK_SHARE,
        step_overhead_s=STEP_OVERHEAD_S,
        link_latency_s=LINK_LATENCY_S,
        fp32_flops=125e12,
        fp8_flops=1000e12,
    ),  # [RTXPRO-DS]
}


def gpu(name: str) -> Gpu:
    """The table's entry; a one-line error listing the names for anything else."""
    if name not in GPUS:
        raise ConfigError(f"unknown GPU {name!r}: choose one of {', '.join(sorted(GPUS))}")
    return GPUS[name]
