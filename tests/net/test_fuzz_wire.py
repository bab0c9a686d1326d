"""Property tests of the message wire's codec (testbed/net/wire.py): every registered message type,
generated from its declared fields, comes back as it left; arbitrary bytes, arbitrary envelopes
and damaged frames never raise anything but BadMessage."""

from __future__ import annotations

import json
import typing

import pytest
from hypothesis import given
from hypothesis import strategies as st

from testbed.net import limits, wire
from tests.fuzzing import fuzz_selected, long, quick  # noqa: F401 - fuzz_selected is a fixture

TOKEN = "b" * 32
SCALAR = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20)
JSON = st.recursive(
    SCALAR,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
DEEP_TUPLE = st.recursive(
    st.integers() | st.text(max_size=8), lambda inner: st.lists(inner, max_size=4).map(tuple), max_leaves=12
).filter(lambda v: isinstance(v, tuple))


def of(hint) -> st.SearchStrategy:
    """Values of a message field's declared type, as the engine makes them."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    simple = {
        int: st.integers(),
        float: st.floats(allow_nan=False),
        bool: st.booleans(),
        str: st.text(max_size=30),
        dict: st.dictionaries(st.text(max_size=8), JSON, max_size=4),
        tuple: DEEP_TUPLE,
        list: st.lists(st.tuples(st.integers(), st.integers()), max_size=4),
    }
    if isinstance(hint, type) and issubclass(hint, tuple) and hasattr(hint, "_fields"):  # StepRecord, StepReport
        return st.builds(hint, *[of(h) for h in typing.get_type_hints(hint).values()])
    if hint in simple:
        return simple[hint]
    if origin is typing.Union:
        return st.none() | of(next(a for a in args if a is not type(None)))
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return st.lists(of(args[0]), max_size=6).map(tuple)
    if origin is tuple:
        return st.tuples(*[of(a) for a in args])
    if origin is list:
        return st.lists(of(args[0]), max_size=6)
    raise AssertionError(f"no strategy for {hint}: add one (a new field type on the wire)")


MESSAGES = st.one_of(
    [st.builds(cls, **{f: of(h) for f, h in typing.get_type_hints(cls).items()}) for cls in wire.MESSAGE_TYPES.values()]
)


def round_trip(msg):
    back = wire.decode(wire.encode(msg, TOKEN), TOKEN)
    assert back == msg and type(back) is type(msg)


def only_bad_message(frame: bytes):
    try:
        wire.decode(frame, TOKEN)
    except wire.BadMessage as refused:
        assert refused.reason and "\n" not in str(refused)


ENVELOPES = st.builds(
    lambda name, body, v: json.dumps({"v": v, "token": TOKEN, "type": name, "body": body}).encode(),
    st.sampled_from(sorted(wire.MESSAGE_TYPES)) | st.text(max_size=10),
    st.dictionaries(st.sampled_from(sorted({f for fs in wire.FIELDS.values() for f in fs})), JSON, max_size=8) | JSON,
    st.sampled_from([1, 1.0, True, 2, None, "1"]),
)
FRAMES = st.tuples(MESSAGES, st.integers(0, 10_000), st.binary(max_size=8)).map(
    lambda t: (lambda f: f[: t[1] % (len(f) + 1)] + t[2] + f[t[1] % (len(f) + 1) + len(t[2]) :])(
        wire.encode(t[0], TOKEN)
    )
)

test_every_message_type_round_trips = quick(given(MESSAGES)(round_trip))
test_every_message_type_round_trips_fuzz = long(given(MESSAGES)(round_trip))
test_arbitrary_bytes_are_refused_as_bad_messages = quick(given(st.binary(max_size=512))(only_bad_message))
test_arbitrary_bytes_are_refused_as_bad_messages_fuzz = long(given(st.binary(max_size=4096))(only_bad_message))
test_arbitrary_envelopes_are_refused_as_bad_messages = quick(given(ENVELOPES)(only_bad_message))
test_arbitrary_envelopes_are_refused_as_bad_messages_fuzz = long(given(ENVELOPES)(only_bad_message))
test_damaged_frames_are_refused_as_bad_messages = quick(given(FRAMES)(only_bad_message))
test_damaged_frames_are_refused_as_bad_messages_fuzz = long(given(FRAMES)(only_bad_message))


@pytest.mark.parametrize("frame", [b"[" * 100_000, b'{"a":' * 50_000, b"[" * 20 + b"]" * 20])
def test_deep_nesting_is_refused_before_it_is_parsed(frame):
    with pytest.raises(wire.BadMessage) as refused:
        wire.decode(frame, TOKEN)
    assert refused.value.reason == "too deep"


def test_an_oversized_frame_is_refused_before_it_is_parsed(monkeypatch):
    monkeypatch.setattr(wire, "MAX_FRAME", 100)
    with pytest.raises(wire.BadMessage) as refused:
        wire.decode(b'{"v": 2, "pad": "' + b"x" * 200 + b'"}', TOKEN)
    assert refused.value.reason == "oversized" and "limit is 100" in str(refused.value)


@pytest.mark.parametrize(
    "body, reason",
    [
        ({"rid": "7", "prompt": [1], "max_tokens": 2}, "bad field"),
        ({"rid": 7, "prompt": [1, "x"], "max_tokens": 2}, "bad field"),
        ({"rid": 7, "prompt": 5, "max_tokens": 2}, "bad field"),
        ({"rid": True, "prompt": [1], "max_tokens": 2}, "bad field"),
    ],
)
def test_a_field_of_the_wrong_type_is_refused(body, reason):
    frame = json.dumps({"v": 2, "token": TOKEN, "type": "Serve", "body": body}).encode()
    with pytest.raises(wire.BadMessage) as refused:
        wire.decode(frame, TOKEN)
    assert refused.value.reason == reason


def test_nesting_depth_ignores_brackets_in_strings():
    assert limits.nesting_depth(b'{"a": "[[[[[[", "b": [[1]]}') == 3
    assert limits.nesting_depth(b'"\\"[[[["') == 0 and limits.nesting_depth(b"[[]][]") == 2
