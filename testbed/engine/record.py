"""The engine's side of a steps.parquet row (testbed/metrics/record.py's StepRecord): the batch's
shape as a cost model reads it, the prefix-cache hits of a step, and its forward's device time."""

from __future__ import annotations

import torch


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


class ForwardClock:
    """The forward's time where the device runs it asynchronously. On CUDA the host's stamp after
    the forward shows only its launches, and the sampled tokens' sync absorbs the GPU work, so
    CUDA events around the forward time it on the stream; the forward and the sampling keep their
    sum (the host's). Elsewhere the host's stamps are the times."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        """An event recorded on the current stream (CUDA), else None."""
        if not self.cuda:
            return None
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    @staticmethod
    def split(start, end, forward_s: float, sample_s: float) -> tuple[float, float]:
        """(forward_s, sample_s): the events' span as the forward, when the step has synced since
        `end` was recorded (the sampled tokens), at most the two together."""
        if start is None:
            return forward_s, sample_s
        total = forward_s + sample_s
        device_s = min(max(start.elapsed_time(end) / 1e3, forward_s), total)
        return device_s, total - device_s
