"""Text prompts of exact token lengths, for servers that are sent text (`http.prompt=text`).

The workload draws token ids; a server that takes text gets them decoded. Decoding and
encoding again rarely gives back the same count (merges across token boundaries), so the ids
are adjusted to what the tokenizer reads back and tried again, as vLLM's random dataset does;
the request records the count the server will see.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from testbed.errors import ConfigError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
ROUNDS = 4


def find_tokenizer(path) -> Optional[object]:
    """The Hugging Face tokenizer in `path`, or None when it holds none (or no path)."""
    if path is None:
        return None
    directory = Path(path).expanduser()
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        return None
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ConfigError(f"the tokenizer in {directory} needs transformers: pip install transformers") from None
    return AutoTokenizer.from_pretrained(str(directory))


def need_tokenizer(path) -> object:
    tokenizer = find_tokenizer(path)
    if tokenizer is None:
        raise ConfigError(
            f"http.prompt=text needs a tokenizer directory (tokenizer.json or tokenizer_config.json): "
            f"set http.tokenizer=DIR (or model.path); got {path!r}"
        )
    return tokenizer


class TextPrompts:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def text(self, ids: Sequence[int]) -> tuple[str, tuple[int, ...]]:
        """(text, the ids the tokenizer reads in it): as many as `ids` when decoding allows."""
        target, ids = len(ids), [int(t) for t in ids]
        text, read = "", []
        for _ in range(ROUNDS):
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            read = self.tokenizer.encode(text, add_special_tokens=False)
            if len(read) == target:
                break
            ids = (read + ids)[:target]  # keep what reads back stably, top up from the draw
        return text, tuple(read)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)
