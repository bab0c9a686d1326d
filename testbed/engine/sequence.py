"""A request inside an engine: its tokens, its KV blocks and where it is in its life.

    WAITING --admit--> RUNNING --last token--> FINISHED
      ^  |               |  |
      |  +--preempt------+  +--first token on a prefill-only worker--> TRANSFERRING --KV left--> FINISHED
      |    (recompute)                     (KV held for a decode worker until it has left)
      |
      +--recompute-- RECEIVING <--reserve-- WAITING   (decode worker: blocks reserved for KV on its way)
                        |
                        +--KV installed with its first token--> RUNNING
    any state but FINISHED --abort (error, timeout, lost worker)--> FAILED

`EDGES` is that drawing; only the Scheduler changes a status, through `Scheduler.move`, which
refuses an edge not in it. Prefill and decode are one thing here: computing `n` new tokens of
the sequence. A sequence is "in prefill" while more than its last token lacks KV, or before
its first output token.
"""

from __future__ import annotations

from enum import Enum

from testbed.errors import ConfigError


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    TRANSFERRING = "transferring"  # P: prefilled, KV held until it has left
    RECEIVING = "receiving"  # D: blocks reserved, KV on its way
    FINISHED = "finished"
    FAILED = "failed"


S = SequenceStatus
EDGES: dict[SequenceStatus, frozenset[SequenceStatus]] = {
    S.WAITING: frozenset({S.RUNNING, S.RECEIVING, S.FAILED}),
    S.RUNNING: frozenset({S.WAITING, S.TRANSFERRING, S.FINISHED, S.FAILED}),
    S.TRANSFERRING: frozenset({S.FINISHED, S.FAILED}),
    S.RECEIVING: frozenset({S.RUNNING, S.WAITING, S.FAILED}),
    S.FINISHED: frozenset(),
    S.FAILED: frozenset(),
}


class Sequence:
    def __init__(self, seq_id: int, prompt_token_ids: list[int], max_tokens: int):
        assert prompt_token_ids, "a sequence needs at least one prompt token"
        assert max_tokens >= 1, "a sequence must produce at least one token"
        self.seq_id = seq_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.max_tokens = max_tokens
        self.num_computed_tokens = 0  # tokens whose KV is in the pool
        self.num_cached_tokens = 0  # of those, found in the prefix cache at admission
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # chain hashes of the leading full blocks with KV (prefix caching)
        self.status = SequenceStatus.WAITING
        self.num_preemptions = 0

    def __repr__(self) -> str:
        return (
            f"Sequence({self.seq_id}, {self.status.value}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})"
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def in_prefill(self) -> bool:
        n = len(self.token_ids)  # the hottest check of a long simulation: no property chain
        return n == self.num_prompt_tokens or n - self.num_computed_tokens > 1

    @property
    def is_done(self) -> bool:
        return self.num_output_tokens >= self.max_tokens

    def append_token(self, token_id: int) -> None:
        assert not self.is_done, f"{self} already has its {self.max_tokens} tokens"
        self.token_ids.append(token_id)

    def reset_for_recompute(self) -> None:
        """Preempted: its KV is dropped and it will be recomputed, generated tokens included
        (the scheduler moves it back to WAITING)."""
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.num_preemptions += 1


def check_fits(prompt_len: int, max_tokens: int, max_model_len: int) -> None:
    """A request must fit the model's context (the engine refuses it; the simulator likewise)."""
    if prompt_len + max_tokens > max_model_len:
        raise ConfigError(
            f"request of {prompt_len} prompt + {max_tokens} output tokens exceeds model.max_model_len={max_model_len}"
        )
