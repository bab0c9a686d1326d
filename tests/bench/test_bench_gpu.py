"""The GPU benchmark's method on CPU (tiny shape): ceilings measured, every row present, each ratio
the ideal time over the measured one. That a step stays below its ceiling is the benchmark's
finding on a quiet device, not a premise: on a busy host a ceiling timed in a crowded moment lay
below a step timed in a quieter one (ratio above 1, in the suite beside two busy processes)."""

import math

import pytest

from testbed.bench.gpu import lines, prefill_flops, run

pytestmark = pytest.mark.slow


def test_engine_against_ceilings_on_cpu():
    result = run("tiny", "cpu", context=32, batches=[1, 3], prefill_lens=[64], repeats=1, steps=2)
    assert result["hbm_gbps"] > 0 and result["matmul_tflops"] > 0
    kinds = [(r["what"], r["batch"]) for r in result["rows"]]
    assert kinds == [("decode", 1), ("decode", 3), ("prefill", 1)]
    for r in result["rows"]:
        assert math.isfinite(r["seconds"]) and r["seconds"] > 0 and r["ideal_s"] > 0
        assert r["ratio"] == pytest.approx(r["ideal_s"] / r["seconds"])
    assert len(lines(result)) == 2 + len(result["rows"])


def test_prefill_flops_count_weights_and_causal_attention():
    class Args:
        vocab_size, hidden_size, num_layers, num_heads, head_dim = 10, 4, 2, 2, 2

    class Engine:
        args = Args()

        class runner:  # noqa: N801
            class model:  # noqa: N801
                class layers:  # noqa: N801
                    @staticmethod
                    def parameters():
                        import torch

                        return [torch.zeros(100)]  # the layers' 100; embedding and head apart

    # the layers for every token, the head (10 x 4) for the one sampled, causal attention
    assert prefill_flops(Engine(), 8) == 2 * 100 * 8 + 2 * 10 * 4 + 2 * 2 * 2 * 2 * 2 * 64 / 2
