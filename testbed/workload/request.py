"""One request of a workload, and the helpers that turn numpy token arrays into prompts."""

from __future__ import annotations

from dataclasses import dataclass
from operator import itemgetter
from typing import Optional, Sequence

import numpy as np


@dataclass(frozen=True)
class Request:
    request_id: int
    arrival_s: float  # seconds from the start of the run
    prompt_token_ids: tuple[int, ...]
    output_len: int
    session_id: Optional[int] = None
    turn: int = 0
    tenant: str = "default"
    prefix_block_ids: tuple[int, ...] = ()

    @property
    def input_len(self) -> int:
        return len(self.prompt_token_ids)


class TokenTable:
    """Shared int objects for token ids 0..vocab-1.

    A prompt tuple built from `ndarray.tolist()` holds one fresh int object (28 bytes) per token
    above 256; looking the ids up in one table makes every tuple slot a shared reference, which
    keeps a long trace's prompts about four times smaller.
    """

    def __init__(self, vocab_size: int):
        self._ints = list(range(vocab_size))

    def as_tuple(self, token_ids: Sequence[int] | np.ndarray) -> tuple[int, ...]:
        ids = np.asarray(token_ids, dtype=np.int64).tolist()
        if len(ids) == 0:
            return ()
        if len(ids) == 1:
            return (self._ints[ids[0]],)
        return itemgetter(*ids)(self._ints)


def random_tokens(rng: np.random.Generator, n: int, vocab_size: int) -> np.ndarray:
    return rng.integers(0, vocab_size, size=n, dtype=np.int64)


def derived_rng(seed: int, *path: int) -> np.random.Generator:
    """A generator that depends only on (seed, path): the same stream in every process, whatever
    else was drawn before. Paths start with a tag so different uses never share a stream."""
    return np.random.default_rng(np.random.SeedSequence([seed, *path]))


# Tags for derived_rng: one per use of randomness.
TAG_ARRIVALS, TAG_LENGTHS, TAG_PROMPTS, TAG_BLOCKS, TAG_SYSTEM, TAG_TURNS, TAG_TENANTS, TAG_THINK = range(1, 9)
