"""Bounds checked on outside JSON before it is parsed: size and nesting depth.

Python's json parser recurses once per level of nesting: a frame or body of 100 KB of `[` makes
it raise RecursionError (no ValueError handler catches that), and a deep enough document can
take the interpreter's stack with it. `nesting_depth` finds the depth without parsing: strings
are cut out (brackets inside them do not nest), then the running count of opening minus closing
brackets is summed over the rest in numpy. A document with few brackets cannot be deep, so the
common small message costs two `count` calls.
"""

from __future__ import annotations

import json
import re

import numpy as np

STRINGS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
OPEN, CLOSE = b"[{", b"]}"
KEEP = bytes(range(256)).translate(None, OPEN + CLOSE)  # every byte that is not a bracket


class TooLarge(ValueError):
    """Outside JSON over a size or depth bound (the message names which and the limit)."""


def nesting_depth(data: bytes) -> int:
    """The deepest nesting of arrays and objects in `data` (brackets inside strings do not count;
    for a document that is not JSON, an upper bound of what a parser would meet)."""
    brackets = STRINGS.sub(b"", data).translate(None, KEEP)
    if not brackets:
        return 0
    codes = np.frombuffer(brackets, dtype=np.uint8)
    steps = np.where((codes == ord("[")) | (codes == ord("{")), 1, -1).astype(np.int32)
    return int(np.cumsum(steps).max(initial=0))


def check(data: bytes, max_bytes: int, max_depth: int, what: str) -> None:
    """TooLarge naming `what` when `data` is over either bound."""
    if len(data) > max_bytes:
        raise TooLarge(f"{what} has {len(data)} bytes; the limit is {max_bytes}")
    if data.count(b"[") + data.count(b"{") > max_depth:
        depth = nesting_depth(data)
        if depth > max_depth:
            raise TooLarge(f"{what} nests {depth} levels deep; the limit is {max_depth}")


def loads(data: bytes | str, max_bytes: int, max_depth: int, what: str):
    """json.loads after `check`; TooLarge or ValueError (not JSON) otherwise, never RecursionError."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    check(raw, max_bytes, max_depth, what)
    try:
        return json.loads(data)
    except RecursionError:  # a bound above the interpreter's own: still the parser's refusal
        raise TooLarge(f"{what} nests deeper than the parser's stack allows") from None
