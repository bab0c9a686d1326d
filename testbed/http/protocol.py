"""The OpenAI completions protocol as both sides speak it: a request checked field by field
(each refusal one line that names the field and what is allowed), the stream's chunks, and
the client's reading of them. Pure functions: the server and the executor add the I/O."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from testbed.net import limits

# The OpenAI completions fields, and the vLLM/SGLang extensions benchmark clients send.
FIELDS = (
    "model",
    "prompt",
    "max_tokens",
    "stream",
    "stream_options",
    "temperature",
    "top_p",
    "n",
    "best_of",
    "logprobs",
    "echo",
    "stop",
    "seed",
    "user",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "suffix",
    "ignore_eos",
    "min_tokens",
    "return_token_ids",
    "repetition_penalty",
    "top_k",
    "min_p",
)
# Values the engine can honour (it decodes greedily, one choice, no logprobs, no stop strings):
# field -> (allowed values, what to say). None (JSON null) is always allowed.
ONLY = {
    "n": ((1,), "1"),
    "best_of": ((1,), "1"),
    "echo": ((False,), "false"),
    "logprobs": ((), "null"),
    "temperature": ((0, 0.0), "0 (greedy decoding)"),
    "top_p": ((1, 1.0), "1"),
    "top_k": ((-1, 0), "-1 or 0"),
    "min_p": ((0, 0.0), "0"),
    "presence_penalty": ((0, 0.0), "0"),
    "frequency_penalty": ((0, 0.0), "0"),
    "repetition_penalty": ((1, 1.0), "1"),
    "stop": (("", ()), "null or empty"),
    "suffix": (("",), "null"),
    "logit_bias": (({},), "null or {}"),
}
DEFAULT_MAX_TOKENS = 16  # OpenAI's
MAX_DEPTH = 8  # nesting of a request body: a batch of one prompt is 2 levels, stream_options 2
BODY_BASE = 1 << 20  # bytes of a body beyond its prompt (fields, whitespace)
BODY_PER_TOKEN = 64  # bytes a prompt token may take, as an id in JSON or as text


def body_limit(max_model_len: int) -> int:
    """The largest body a request for this model can need: a longer one is refused unread."""
    return BODY_BASE + BODY_PER_TOKEN * max_model_len


class BadRequest(ValueError):
    """A request the server refuses: `status` and a one-line reason."""

    def __init__(self, reason: str, status: int = 400):
        super().__init__(reason)
        self.status = status


@dataclass(frozen=True)
class Completion:
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    stream: bool
    include_usage: bool
    return_token_ids: bool
    model: str


def parse_completion(
    body: bytes, *, vocab_size: int, max_model_len: int, model: str, encode: Optional[Callable[[str], list[int]]] = None
) -> Completion:
    """The request in `body`, or BadRequest naming what is wrong."""
    try:
        data = limits.loads(body, body_limit(max_model_len), MAX_DEPTH, "the body")
    except limits.TooLarge as error:
        raise BadRequest(str(error), status=413 if "bytes" in str(error) else 400) from None
    except (ValueError, UnicodeDecodeError) as error:
        raise BadRequest(f"the body is not valid JSON ({str(error).splitlines()[0][:200]})") from None
    if not isinstance(data, dict):
        raise BadRequest("the body must be a JSON object with the completions fields")
    unknown = sorted(set(data) - set(FIELDS))
    if unknown:
        shown = ", ".join(name if name.isprintable() else json.dumps(name) for name in unknown[:5])[:200]
        raise BadRequest(f"unknown field(s) {shown}; allowed: {', '.join(FIELDS)}")
    for key, (allowed, say) in ONLY.items():
        value = data.get(key)
        if value is not None and not _one_of(value, allowed):
            raise BadRequest(f"{key}={json.dumps(value)} is not supported; allowed: {say}")
    if data.get("model") not in (None, model):
        raise BadRequest(f"model={data['model']!r} is not served here; allowed: {model!r}", status=404)
    prompt = _prompt(data.get("prompt"), vocab_size, max_model_len, encode)
    max_tokens = _max_tokens(data, len(prompt), max_model_len)
    options = data.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
        raise BadRequest("stream_options must be an object with include_usage (true/false)")
    return Completion(
        prompt,
        max_tokens,
        _flag(data, "stream"),
        bool(options.get("include_usage")),
        _flag(data, "return_token_ids"),
        model,
    )


def _one_of(value: Any, allowed: Sequence) -> bool:
    if isinstance(value, list):
        value = tuple(value)
    return any(value == a and isinstance(value, bool) == isinstance(a, bool) for a in allowed)  # True is not 1


def _flag(data: dict, key: str) -> bool:
    value = data.get(key, False)
    if value is not None and not isinstance(value, bool):
        raise BadRequest(f"{key} must be true or false (got {json.dumps(value)})")
    return bool(value)


def _prompt(prompt: Any, vocab_size: int, max_model_len: int, encode) -> tuple[int, ...]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
        if len(prompt) > 1:
            raise BadRequest(
                f"prompt is a batch of {len(prompt)} prompts; batches of several prompts are not "
                f"supported: send one request per prompt"
            )
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        if encode is None:
            raise BadRequest("prompt is text but this server has no tokenizer; send token ids (a list of integers)")
        size = _utf8_size(prompt)
        if size is None:
            raise BadRequest("prompt text is not valid Unicode (a lone surrogate escape)")
        if size > BODY_PER_TOKEN * max_model_len:  # before tokenizing: a huge text would hold the server up
            raise BadRequest(
                f"the prompt text has {size} bytes; the limit is {BODY_PER_TOKEN * max_model_len} "
                f"({BODY_PER_TOKEN} per token of max_model_len {max_model_len})",
                status=413,
            )
        prompt = encode(prompt)
    if not isinstance(prompt, list) or not prompt:
        raise BadRequest("prompt must be a non-empty list of token ids (or one text with a tokenizer)")
    if len(prompt) >= max_model_len:  # before every id is looked at: a long list is refused at once
        raise BadRequest(
            f"the prompt has {len(prompt)} tokens; the model allows {max_model_len - 1} "
            f"(max_model_len {max_model_len}, one output token at least)"
        )
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size for t in prompt):
        raise BadRequest(f"prompt token ids must be integers in [0, {vocab_size})")
    return tuple(prompt)


def _utf8_size(text: str) -> Optional[int]:
    """Its size in UTF-8 bytes; None when it is not valid Unicode."""
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError:
        return None


def _max_tokens(data: dict, prompt_len: int, max_model_len: int) -> int:
    room = max_model_len - prompt_len
    if room < 1:
        raise BadRequest(
            f"the prompt has {prompt_len} tokens; the model allows {max_model_len - 1} "
            f"(max_model_len {max_model_len}, one output token at least)"
        )
    value = data.get("max_tokens")
    value = DEFAULT_MAX_TOKENS if value is None else value
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= room:
        raise BadRequest(
            f"max_tokens={json.dumps(value)} is out of range; allowed: 1..{room} for this "
            f"{prompt_len}-token prompt (max_model_len {max_model_len})"
        )
    minimum = data.get("min_tokens")
    if minimum is not None and (not isinstance(minimum, int) or isinstance(minimum, bool) or not 0 <= minimum <= value):
        raise BadRequest(f"min_tokens={json.dumps(minimum)} is out of range; allowed: 0..max_tokens ({value})")
    return value


# -- the stream -------------------------------------------------------------------------------
def chunk(rid: int, model: str, text: str, token_ids: Optional[list[int]], finish: Optional[str]) -> bytes:
    """One server-sent event of a completion stream."""
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return _event(
        {
            "id": f"cmpl-{rid}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": [choice],
        }
    )


def usage_chunk(rid: int, model: str, prompt_tokens: int, completion_tokens: int) -> bytes:
    return _event(
        {
            "id": f"cmpl-{rid}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": [],
            "usage": usage(prompt_tokens, completion_tokens),
        }
    )


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def error_chunk(reason: str) -> bytes:
    return _event(error_body(reason, 503))


DONE = b"data: [DONE]\n\n"


def _event(body: dict) -> bytes:
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


def error_body(reason: str, status: int) -> dict:
    """OpenAI's error object: what its clients parse for every 4xx/5xx."""
    return {
        "error": {
            "message": reason,
            "type": "invalid_request_error" if status < 500 else "server_error",
            "param": None,
            "code": status,
        }
    }


# -- the client's reading ------------------------------------------------------------------------
@dataclass(frozen=True)
class Delta:
    """What one chunk of a stream carried: tokens (ids when the server gives them, else a count
    of one per chunk with text), the usage total, an error, or the end."""

    count: int = 0
    token_ids: Optional[list[int]] = None
    usage_tokens: Optional[int] = None
    error: str = ""
    done: bool = False


def read_event(line: bytes) -> Optional[Delta]:
    """One line of a server-sent-event stream; None for lines that carry nothing (blank,
    comments, keep-alives)."""
    line = line.strip()
    if not line.startswith(b"data:"):
        return None
    payload = line[5:].strip()
    if payload == b"[DONE]":
        return Delta(done=True)
    try:
        data = json.loads(payload)
    except ValueError:
        data = None
    if not isinstance(data, dict):
        return Delta(error=f"a stream chunk is not a JSON object: {payload[:80]!r}")
    if "error" in data:
        error = data["error"]
        return Delta(error=str(error.get("message", error) if isinstance(error, dict) else error))
    used = (data.get("usage") or {}).get("completion_tokens")
    choices = data.get("choices") or []
    if not choices:
        return Delta(usage_tokens=used)
    ids = choices[0].get("token_ids")
    if ids is not None:
        return Delta(count=len(ids), token_ids=[int(t) for t in ids], usage_tokens=used)
    return Delta(count=1 if choices[0].get("text") else 0, usage_tokens=used)
