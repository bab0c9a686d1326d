"""Attention backends against SDPA: python -m testbed.bench.parity [--device cuda:0] [--size tiny]

Random paged batches at Llama-3-8B's head geometry (32 query heads, 8 KV heads, head dim 128),
scattered blocks of a block-major pool read through one layer's strided views (as the engine's),
fresh draws per case: every backend this device can run (flash-attn, the Triton
decode kernel) against the torch SDPA backend computed in float32 on the same inputs, as the
relative error ||out - ref|| / ||ref||. bf16 operands land between 1e-3 and 1e-2; NaN never passes.
`--size tiny` runs the same cases at a small shape (8 query heads over 2 KV heads of dim 64, fewer
and shorter sequences, still spanning several blocks of either size): a check of the bench itself
on a CPU (scripts/gpu_check --smoke), where the full shape's bf16 attention takes tens of seconds.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

import torch

from testbed.errors import ConfigError
from testbed.model.attention import AttentionMetadata, TorchAttention, block_stride, select_backend, write_kv

HEADS, KV_HEADS, DIM = 32, 8, 128
# (name, new tokens per sequence, context per sequence after the step): decodes first, as the runner orders
CASES = {
    "decode x64": ([1] * 64, [1 + 61 * i for i in range(64)]),
    "mixed": ([1] * 8 + [512, 300, 77], [40 * i + 3 for i in range(8)] + [512, 1800, 1000]),
}


@dataclass(frozen=True)
class Shape:
    """The heads and the cases a parity run draws."""

    heads: int
    kv_heads: int
    dim: int
    cases: dict  # {name: (new tokens per sequence, context per sequence after the step)}


SHAPES = {
    "full": Shape(HEADS, KV_HEADS, DIM, CASES),
    # the same kinds of step, small: decodes whose contexts span two 256-token blocks, a fresh prefill,
    # chunks after a cached context, grouped queries (4 per KV head)
    "tiny": Shape(
        8,
        2,
        64,
        {
            "decode x8": ([1] * 8, [1 + 61 * i for i in range(8)]),
            "mixed": ([1] * 4 + [64, 40, 17], [40 * i + 3 for i in range(4)] + [64, 300, 200]),
        },
    ),
}


def paged_batch(q_lens, kv_lens, block_size: int, device, dtype, seed: int, shape: Shape = SHAPES["full"]):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    blocks = sum(-(-n // block_size) for n in kv_lens) + 2
    ids = torch.randperm(blocks, generator=gen).tolist()
    tables, used = [], 0
    for n in kv_lens:
        tables.append(ids[used : used + -(-n // block_size)])
        used += len(tables[-1])
    rand = lambda *shape: torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)  # noqa: E731
    heads, kv_heads, dim = shape.heads, shape.kv_heads, shape.dim
    pool = rand(blocks, 1, 2, block_size, kv_heads, dim)  # (blocks, layers, K/V, ...): the engine's layout
    k_cache, v_cache = pool[:, 0, 0], pool[:, 0, 1]  # a block's K and V 2 x block_size rows apart
    stride = block_stride(k_cache)
    t = sum(q_lens)
    q, k, v = rand(t, heads, dim), rand(t, kv_heads, dim), rand(t, kv_heads, dim)
    slots = [
        tab[p // block_size] * stride + p % block_size
        for tab, ql, kl in zip(tables, q_lens, kv_lens)
        for p in range(kl - ql, kl)
    ]
    width = max(len(x) for x in tables)
    to = lambda x, dt: torch.tensor(x, dtype=dt, device=device)  # noqa: E731
    cu = lambda xs: to([0, *torch.tensor(xs).cumsum(0).tolist()], torch.int32)  # noqa: E731
    meta = AttentionMetadata(
        q_lens=list(q_lens),
        kv_lens=list(kv_lens),
        num_single=sum(1 for x in q_lens if x == 1),
        slot_mapping=to(slots, torch.int64),
        block_tables=to([x + [0] * (width - len(x)) for x in tables], torch.int32),
        kv_lens_t=to(kv_lens, torch.int32),
        cu_q=cu(q_lens),
        cu_kv=cu(kv_lens),
    )
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    return q, k, v, k_cache, v_cache, meta


def relative_error(name: str, device, block_size: int, case: str, seed: int, shape: Shape = SHAPES["full"]) -> float:
    dtype = torch.bfloat16
    q, k, v, k_cache, v_cache, meta = paged_batch(*shape.cases[case], block_size, device, dtype, seed, shape)
    backend = select_backend(name, device, dtype, block_size)
    out = backend(q, k_cache, v_cache, meta, k=k, v=v).float()
    f = lambda x: x.float()  # noqa: E731
    ref = TorchAttention()(f(q), f(k_cache), f(v_cache), meta, k=f(k), v=f(v))
    return ((out - ref).norm() / ref.norm()).item()


def run(device: str, size: str = "full") -> list[dict]:
    device, shape = torch.device(device), SHAPES[size]
    rows = []
    for name, block_sizes in (("flash", [256]), ("triton", [16, 256]), ("torch", [16])):
        for block_size in block_sizes:
            for seed, case in enumerate(shape.cases):
                try:
                    error = relative_error(name, device, block_size, case, seed, shape)
                except ConfigError as missing:  # the backend cannot run here: say why, once per row
                    rows.append(
                        {
                            "backend": name,
                            "block_size": block_size,
                            "case": case,
                            "error": None,
                            "skipped": str(missing).split(";")[0],
                        }
                    )
                    continue
                rows.append(
                    {
                        "backend": name,
                        "block_size": block_size,
                        "case": case,
                        "error": error,
                        "ok": error == error and error < 1e-2,
                    }
                )  # error == error: not NaN
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--size",
        choices=sorted(SHAPES),
        default="full",
        help="full: Llama-3-8B's heads and the cases above (default); tiny: the same cases small, a check of the bench",
    )
    parser.add_argument("--json")
    a = parser.parse_args(argv)
    rows = run(a.device, a.size)
    print(f"{'backend':>8} {'block':>5} {'case':>11} {'rel. error':>10}")
    for r in rows:
        figure = f"{r['error']:.2e}" if r["error"] is not None else "skipped"
        print(
            f"{r['backend']:>8} {r['block_size']:>5} {r['case']:>11} {figure:>10}"
            + ("" if r.get("ok", True) else "  FAIL")
            + (f"  ({r['skipped']})" if "skipped" in r else "")
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    if any(r.get("ok") is False for r in rows):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
