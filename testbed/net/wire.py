"""The messages' wire format between hosts: versioned JSON, never pickle.

    {"v": 1, "token": "<run token>", "type": "Serve", "body": {"rid": 7, "prompt": [...], ...}}

Only the message types registered here decode, and only into their own fields, each of its
declared type: a frame over MAX_FRAME bytes or MAX_DEPTH levels of nesting (both checked before
it is parsed), not JSON, of another version or type, without the run's token, or with fields the
type does not have or of another type is refused with `BadMessage` (the receiver drops it and
counts it by its `reason`); `decode` raises nothing else, whatever the bytes. Nothing from the
network is ever unpickled or executed. Tuples travel as JSON arrays and come back as tuples where
the field is declared a tuple; a NamedTuple (StepRecord, StepReport) travels as the array of its fields.
Across hosts every frame travels inside CURVE (testbed/net/curve.py): the token is never in clear.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import typing

from testbed.net import limits, messages
from testbed.net.faults import FaultInjected, Stall

VERSION = 2  # 2: step reports carry a StepReport whole


@dataclasses.dataclass(frozen=True)
class Launch:
    """rank 0 -> a remote rank: serve point `point` with this config (the results' config.yaml form)."""

    point: int
    config: dict


@dataclasses.dataclass(frozen=True)
class Shutdown:
    """rank 0 -> a remote rank: the run is over (`error` says why when it failed)."""

    error: str = ""


MAX_FRAME = 64 << 20  # bytes: a 128K-token prompt is about 1 MB of JSON; anything near this is not a message
MAX_DEPTH = 16  # nesting: the deepest message (a StepEvents' record's prefill chunks) is 4 levels down


class BadMessage(ValueError):
    """A frame that is not one of this run's messages; `reason` is the short name it is
    counted under (the full message says more)."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


MESSAGE_TYPES = {
    cls.__name__: cls
    for cls in (
        messages.Serve,
        messages.Reserve,
        messages.Abort,
        messages.Stop,
        messages.Ready,
        messages.KVBegin,
        messages.KVAck,
        messages.KVPart,
        messages.KVDone,
        messages.Started,
        messages.StepEvents,
        messages.Reserved,
        messages.KVSent,
        messages.KVArrived,
        messages.KVAttemptFailed,
        messages.Failed,
        messages.Heartbeat,
        messages.Ping,
        messages.Pong,
        messages.Audit,
        messages.WorkerError,
        FaultInjected,
        Stall,
        Launch,
        Shutdown,
    )
}


def encode(msg, token: str) -> bytes:
    name = type(msg).__name__
    if MESSAGE_TYPES.get(name) is not type(msg):
        raise TypeError(f"{name} is not a message of the wire")
    body = {f: getattr(msg, f) for f in FIELDS[name]}
    return json.dumps(
        {"v": VERSION, "token": token, "type": name, "body": body}, separators=(",", ":"), default=_scalar
    ).encode()


def decode(frame: bytes, token: str):
    """The message in `frame`, or BadMessage naming why it was refused (never any other error)."""
    envelope = _envelope(frame)
    if not hmac.compare_digest(_text(envelope.get("token")).encode("utf-8", "surrogatepass"), token.encode()):
        raise BadMessage("wrong or missing run token")
    name, body = envelope.get("type"), envelope.get("body")
    if not isinstance(name, str) or name not in MESSAGE_TYPES or not isinstance(body, dict):
        raise BadMessage("unknown message type", repr(_text(name)[:40]))
    convert = FIELDS[name]
    if not body.keys() <= convert.keys():
        raise BadMessage("unknown fields", f"{name} has no fields {sorted(body.keys() - convert.keys())[:5]}")
    try:
        return MESSAGE_TYPES[name](**{k: convert[k](v) for k, v in body.items()})
    except (TypeError, ValueError) as error:
        raise BadMessage("bad field", f"{name}: {str(error)[:200]}") from None


def _envelope(frame: bytes) -> dict:
    """The frame's envelope, its size and nesting bounded before it is parsed."""
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise BadMessage("not bytes", type(frame).__name__)
    try:
        envelope = limits.loads(bytes(frame), MAX_FRAME, MAX_DEPTH, "the frame")
    except limits.TooLarge as error:
        raise BadMessage("oversized" if "bytes" in str(error) else "too deep", str(error)) from None
    except (UnicodeDecodeError, ValueError) as error:
        raise BadMessage("not JSON", type(error).__name__) from None
    if not isinstance(envelope, dict) or envelope.get("v") != VERSION or isinstance(envelope.get("v"), bool):
        raise BadMessage(f"not a version-{VERSION} envelope")
    return envelope


def _text(value) -> str:
    return value if isinstance(value, str) else ""


def _scalar(value):
    """numpy scalars (a token id, a block count) as plain numbers; anything else is a bug."""
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"{type(value).__name__} does not travel in a message")


def _deep_tuple(value):
    return tuple(_deep_tuple(v) for v in value) if isinstance(value, list) else value


def _named(cls):
    """A NamedTuple travels as the array of its fields (a tuple to JSON); trailing ones with
    defaults may be left out. Its fields' converters are resolved once."""
    fields = [(name, _converter(hint)) for name, hint in typing.get_type_hints(cls).items()]

    def convert(value):
        if not isinstance(value, list) or len(value) > len(fields):
            raise TypeError(f"{cls.__name__} must be an array of its fields")
        return cls(*[field(v) for (_, field), v in zip(fields, value)])

    return convert


def _is_named(hint) -> bool:
    return isinstance(hint, type) and issubclass(hint, tuple) and hasattr(hint, "_fields")


SCALARS = {int: (int,), float: (int, float), bool: (bool,), str: (str,)}  # JSON's types each may arrive as


def _scalar_of(hint):
    allowed = SCALARS[hint]

    def check(value):
        if type(value) not in allowed:
            raise TypeError(f"{type(value).__name__} where {hint.__name__} is expected")
        return value

    return check


def _array(value) -> list:
    if not isinstance(value, list):
        raise TypeError(f"{type(value).__name__} where an array is expected")
    return value


def _mapping(value) -> dict:
    if not isinstance(value, dict):
        raise TypeError(f"{type(value).__name__} where an object is expected")
    return value


def _converter(hint):
    """JSON value -> the field's declared shape (NamedTuples, tuples where tuples are declared),
    TypeError when the value is not of that shape."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if _is_named(hint):
        return _named(hint)
    if hint in SCALARS:
        return _scalar_of(hint)
    if origin is typing.Union:  # Optional[X]
        inner = [a for a in args if a is not type(None)]
        convert = _converter(inner[0]) if len(inner) == 1 else _same
        return lambda v: None if v is None else convert(v)
    if hint is tuple:
        return lambda v: _deep_tuple(_array(v))
    if hint is list:
        return lambda v: [tuple(x) if type(x) is list else x for x in _array(v)]
    if hint is dict:
        return _mapping
    if origin is tuple:
        return _tuple_of(args)
    if origin is list:
        item = _converter(args[0])
        return lambda v: [item(x) for x in _array(v)]
    return _same


def _tuple_of(args: tuple):
    if len(args) == 2 and args[1] is Ellipsis:
        item = _converter(args[0])
        return lambda v: tuple(item(x) for x in _array(v))
    items = [_converter(a) for a in args]

    def fixed(value):
        if len(_array(value)) != len(items):
            raise TypeError(f"an array of {len(items)} where {len(value)} came")
        return tuple(convert(x) for convert, x in zip(items, value))

    return fixed


def _same(value):
    return value


# each message type's fields and how each comes back from JSON, resolved once (annotations are strings)
FIELDS = {
    name: {f: _converter(h) for f, h in typing.get_type_hints(cls).items()} for name, cls in MESSAGE_TYPES.items()
}
