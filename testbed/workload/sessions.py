"""Multi-turn sessions: a shared system prompt, and each next turn built from the previous one.

Turn k+1's prompt is turn k's prompt + turn k's output + a new user message; it arrives a think
time after turn k finished (closed loop). Everything random about turn k+1 comes from a
generator seeded by (seed, session, k+1), so a session replays identically in any process and
whatever order the engine finishes requests in.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence

import numpy as np

from testbed.workload.config import LengthConfig, WorkloadConfig
from testbed.workload.lengths import sample_lengths
from testbed.workload.request import TAG_SYSTEM, TAG_TURNS, Request, TokenTable, derived_rng, random_tokens


def system_prompt(seed: int, length: int, vocab_size: int) -> np.ndarray:
    """The one system prompt every session shares (so prefix caching can share its KV)."""
    return random_tokens(derived_rng(seed, TAG_SYSTEM), length, vocab_size)


@dataclass(frozen=True)
class TurnPlanner:
    """What a session's later turns look like; built once per workload."""

    cfg: WorkloadConfig
    seed: int
    vocab_size: int
    max_model_len: int
    num_sessions: int  # first-turn request ids are 0..num_sessions-1; later turns follow on
    tokens: TokenTable

    def lengths_for(self, tenant: str) -> tuple[LengthConfig, LengthConfig]:
        for t in self.cfg.tenants:
            if t.name == tenant:
                return t.input_len, t.output_len
        return self.cfg.input_len, self.cfg.output_len

    def next_turn(
        self, request: Request, output_token_ids: Sequence[int], finished_s: float
    ) -> tuple[Optional[Request], str]:
        """(the next turn, "") or (None, why the session ended: "done" or "overlength")."""
        turn = request.turn + 1
        if request.session_id is None or turn >= self.cfg.turns:
            return None, "done"
        rng = derived_rng(self.seed, TAG_TURNS, request.session_id, turn)
        input_cfg, output_cfg = self.lengths_for(request.tenant)
        user_len = int(sample_lengths(input_cfg, 1, rng)[0][0])
        output_len = int(sample_lengths(output_cfg, 1, rng)[0][0])
        think = self.cfg.think_s(closed=False)
        if self.cfg.think_time_dist == "exponential":
            think = float(rng.exponential(think))
        history = list(request.prompt_token_ids) + [int(t) for t in output_token_ids]
        prompt = np.concatenate([np.asarray(history, dtype=np.int64), random_tokens(rng, user_len, self.vocab_size)])
        room = self.max_model_len - len(prompt)
        if room < 1 or (room < output_len and self.cfg.overlength == "reject"):
            # A session's history cannot be clipped without breaking the turn: it ends here.
            return None, "overlength"
        return replace(
            request,
            request_id=turn * self.num_sessions + request.session_id,
            arrival_s=float(finished_s) + think,
            prompt_token_ids=self.tokens.as_tuple(prompt),
            output_len=min(output_len, room),
            turn=turn,
            prefix_block_ids=(),
        ), ""
