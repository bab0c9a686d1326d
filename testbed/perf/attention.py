"""How many keys a prefill chunk's attention computes: the one quantity both cost models share."""

from __future__ import annotations

from typing import Iterable


def attended_context(chunks: Iterable[tuple[int, int]], causal: bool = True) -> float:
    """Mean keys computed per new token over prefill chunks given as (new tokens, cached tokens).
    A causal kernel (flash-attn) skips the masked half of a chunk: token i after k cached tokens
    costs k + i keys; a dense masked kernel (torch SDPA) computes k + n keys for every token."""
    tokens = pairs = 0.0
    for new, cached in chunks:
        tokens += new
        pairs += new * cached + (new * (new + 1) / 2 if causal else new * new)
    return pairs / tokens if tokens else 0.0
