"""The control messages' wire format between hosts: versioned JSON, never pickle.

    {"v": 1, "token": "<run token>", "type": "Serve", "body": {"rid": 7, "prompt": [...], ...}}

Only the message types registered here decode, and only into their own fields: a frame that is
not JSON, names another version or type, lacks the run's token, or carries fields the type does
not have is refused with `BadMessage` (the receiver drops and counts it). Nothing from the network
is ever unpickled or executed. Tuples travel as JSON arrays and come back as tuples where the
field is declared a tuple; StepRecord (a NamedTuple) travels as the array of its fields.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import typing

from testbed.cluster import messages
from testbed.cluster.faults import FaultInjected, Stall
from testbed.engine.record import StepRecord

VERSION = 1


@dataclasses.dataclass(frozen=True)
class Launch:
    """rank 0 -> a remote rank: serve point `point` with this config (the results' config.yaml form)."""

    point: int
    config: dict


@dataclasses.dataclass(frozen=True)
class Shutdown:
    """rank 0 -> a remote rank: the run is over (`error` says why when it failed)."""

    error: str = ""


class BadMessage(ValueError):
    """A frame that is not one of this run's control messages."""


MESSAGE_TYPES = {cls.__name__: cls for cls in (
    messages.Serve, messages.Reserve, messages.Abort, messages.Stop, messages.Ready, messages.KVBegin,
    messages.KVAck, messages.KVPart, messages.KVDone, messages.Started, messages.StepEvents, messages.Reserved,
    messages.KVSent, messages.KVArrived, messages.KVAttemptFailed, messages.Failed, messages.Heartbeat,
    messages.Ping, messages.Pong,
    messages.Audit, messages.WorkerError, FaultInjected, Stall, Launch, Shutdown)}
def encode(msg, token: str) -> bytes:
    name = type(msg).__name__
    if MESSAGE_TYPES.get(name) is not type(msg):
        raise TypeError(f"{name} is not a control message")
    body = {f: getattr(msg, f) for f in FIELDS[name]}
    return json.dumps({"v": VERSION, "token": token, "type": name, "body": body}, separators=(",", ":"),
                      default=_scalar).encode()


def decode(frame: bytes, token: str):
    """The message in `frame`, or BadMessage naming why it was refused."""
    try:
        envelope = json.loads(frame)
    except (UnicodeDecodeError, ValueError) as error:
        raise BadMessage(f"not JSON ({type(error).__name__})") from None
    if not isinstance(envelope, dict) or envelope.get("v") != VERSION:
        raise BadMessage(f"not a version-{VERSION} envelope")
    if not hmac.compare_digest(str(envelope.get("token", "")).encode(), token.encode()):
        raise BadMessage("wrong or missing run token")
    name, body = envelope.get("type"), envelope.get("body")
    if name not in MESSAGE_TYPES or not isinstance(body, dict):
        raise BadMessage(f"unknown message type {str(name)[:40]!r}")
    convert = FIELDS[name]
    if not body.keys() <= convert.keys():
        raise BadMessage(f"{name} has no fields {sorted(body.keys() - convert.keys())[:5]}")
    try:
        return MESSAGE_TYPES[name](**{k: convert[k](v) for k, v in body.items()})
    except (TypeError, ValueError) as error:
        raise BadMessage(f"{name}: {error}") from None


def _scalar(value):
    """numpy scalars (a token id, a block count) as plain numbers; anything else is a bug."""
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"{type(value).__name__} does not travel in a control message")


def _deep_tuple(value):
    return tuple(_deep_tuple(v) for v in value) if isinstance(value, list) else value


def _record(value) -> StepRecord:
    """StepRecord travels as the array of its fields (a NamedTuple is a tuple to JSON)."""
    if not isinstance(value, list) or len(value) > len(StepRecord._fields):
        raise TypeError("StepRecord must be an array of its fields")
    return StepRecord(*[_deep_tuple(v) if type(v) is list else v for v in value])


def _converter(hint):
    """JSON value -> the field's declared shape: StepRecord, tuples where tuples are declared."""
    origin = typing.get_origin(hint)
    if hint is StepRecord:
        return _record
    if origin is typing.Union:  # Optional[X]
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        convert = _converter(inner[0]) if len(inner) == 1 else _same
        return lambda v: None if v is None else convert(v)
    if hint is tuple or origin is tuple:
        return lambda v: _deep_tuple(v) if isinstance(v, list) else v
    if hint is list or origin is list:
        return lambda v: [tuple(x) if type(x) is list else x for x in v] if isinstance(v, list) else v
    return _same


def _same(value):
    return value


# each message type's fields and how each comes back from JSON, resolved once (annotations are strings)
FIELDS = {name: {f: _converter(h) for f, h in typing.get_type_hints(cls).items()}
          for name, cls in MESSAGE_TYPES.items()}
