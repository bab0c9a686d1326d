"""The engine's side of a steps.parquet row (testbed/metrics/record.py's StepRecord): the batch's
shape as a cost model reads it, and the prefix-cache hits of a step."""

from __future__ import annotations


def hit_tokens(hits) -> int:
    """The prompt tokens a step's StepResult.hits, (rid, cached tokens) pairs, found cached."""
    return sum(tokens for _, tokens in hits)


def cost_shape(batch) -> tuple[tuple[tuple[int, int], ...], int]:
    """Prefill chunks as (new, cached) pairs and the decodes' total context, read before the step
    runs (as the simulator reads them)."""
    chunks, context = [], 0
    for seq, n in batch.items:
        if seq.in_prefill:
            chunks.append((n, seq.num_computed_tokens))
        else:
            context += len(seq.token_ids)
    return tuple(chunks), context
