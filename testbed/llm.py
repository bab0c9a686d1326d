"""`LLM`: the engine as a library, for notebooks and scripts.

from testbed import LLM
llm = LLM(model="tiny", device="cpu")
outputs = llm.generate([[1, 2, 3], [4, 5]], max_new_tokens=8)   # greedy token ids per prompt
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from testbed.engine import Engine, EngineConfig, SchedulerConfig, Sequence
from testbed.model.config import ModelConfig

_ENGINE_FIELDS = {f.name for f in dataclasses.fields(EngineConfig)}
_SCHEDULER_FIELDS = {f.name for f in dataclasses.fields(SchedulerConfig)}
_MODEL_FIELDS = {f.name for f in dataclasses.fields(ModelConfig)} - {"name", "path"}
# Offline defaults, as vLLM's offline `LLM` sizes its scheduler (max_num_seqs 256, 8192 batched
# tokens): a whole batch of prompts is admitted at once, prefills in one or a few steps and
# decodes together, instead of the serving defaults' 256-token chunks (SchedulerConfig), which
# keep a server's decode steps short. Any of them given to LLM wins.
OFFLINE_SCHEDULER = {"max_running": 256, "max_batched_tokens": 8192, "chunk_size": 8192}


class LLM:
    def __init__(self, model: str = "tiny", device: str = "cpu", policy: str = "chunked", **options):
        unknown = set(options) - _ENGINE_FIELDS - _SCHEDULER_FIELDS - _MODEL_FIELDS
        if unknown:
            raise TypeError(
                f"unknown LLM option(s) {sorted(unknown)}; allowed: "
                f"{sorted(_ENGINE_FIELDS | _SCHEDULER_FIELDS | _MODEL_FIELDS)}"
            )
        pick = lambda names: {k: v for k, v in options.items() if k in names}  # noqa: E731
        is_path = Path(model).is_dir()
        model_config = ModelConfig(
            name="tiny" if is_path else model, path=model if is_path else None, **pick(_MODEL_FIELDS)
        )
        # a length the caller did not ask for (a checkpoint's max_position_embeddings can exceed
        # the default pool) is lowered to what the pool holds; an explicit one the pool cannot hold is an error
        self.engine = Engine.build(
            model_config.args(),
            EngineConfig(**pick(_ENGINE_FIELDS)),
            SchedulerConfig(**offline_scheduler(pick(_SCHEDULER_FIELDS))),
            policy,
            device,
            dtype=model_config.dtype,
            path=model_config.path,
            seed=model_config.seed,
            fit_max_model_len=model_config.max_model_len is None,
        )
        self._next_id = 0

    def generate(self, prompt_token_ids: list[list[int]], max_new_tokens: int | list[int] = 16) -> list[list[int]]:
        lengths = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(prompt_token_ids)
        if len(lengths) != len(prompt_token_ids):
            raise ValueError(f"max_new_tokens has {len(lengths)} entries for {len(prompt_token_ids)} prompts")
        seqs = []
        for prompt, n in zip(prompt_token_ids, lengths):
            seqs.append(Sequence(self._next_id, prompt, n))
            self._next_id += 1
            self.engine.add(seqs[-1])
        self.engine.run_until_done()
        assert self.engine.num_used_blocks == 0, "KV blocks leaked"
        return [seq.output_token_ids for seq in seqs]


def offline_scheduler(given: dict) -> dict:
    """OFFLINE_SCHEDULER under what the caller gave; a chunk size given alone also bounds the
    running sequences (a chunked step must fit one decode token of each)."""
    limits = {**OFFLINE_SCHEDULER, **given}
    if "chunk_size" in given and "max_running" not in given:
        limits["max_running"] = min(limits["max_running"], given["chunk_size"])
    return limits
