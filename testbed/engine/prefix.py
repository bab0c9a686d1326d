"""Prefix-cache block hashes, one rule for the engine and for the router's KV index.

A full block of prompt tokens is named by a chain hash over its parent's hash and its own
tokens, so two prompts share a block's hash only when they share every token up to its end.
Tuples of ints hash the same in every process (the root is an int, not None, whose hash is
its address before Python 3.12), so a worker's reports and the router's lookups agree.
"""

from __future__ import annotations

from typing import Sequence

ROOT = 0  # the parent of a prompt's first block


def block_hash(parent: int, tokens: tuple[int, ...]) -> int:
    return hash((parent, tokens))


def cacheable_blocks(num_tokens: int, block_size: int) -> int:
    """Full blocks a prompt can take from a cache: those strictly before its last token, which
    must be computed to give the next token's logits."""
    return max(num_tokens - 1, 0) // block_size


def prompt_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The chain hashes of the cacheable blocks of a prompt, first block first."""
    hashes, parent = [], ROOT
    for i in range(cacheable_blocks(len(token_ids), block_size)):
        parent = block_hash(parent, tuple(token_ids[i * block_size : (i + 1) * block_size]))
        hashes.append(parent)
    return hashes
