"""The control messages' wire format between hosts: versioned JSON, never pickle.

    {"v": 1, "token": "<run token>", "type": "Serve", "body": {"rid": 7, "prompt": [...], ...}}

Only the message types registered here decode, and only into their own fields: a frame that is
not JSON, names another version or type, lacks the run's token, or carries fields the type does
not have is refused with `BadMessage` (the receiver drops and counts it). Nothing from the network
is ever unpickled or executed. Tuples travel as JSON arrays and come back as tuples where the
field is declared a tuple; StepRecord (a NamedTuple) travels as an object of its fields.
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
    messages.Audit, messages.WorkerError, FaultInjected, Stall, Launch, Shutdown)}
# each field's declared type, resolved once (the annotations are strings)
FIELD_TYPES = {name: typing.get_type_hints(cls) for name, cls in MESSAGE_TYPES.items()}
RECORD_TYPES = typing.get_type_hints(StepRecord)


def encode(msg, token: str) -> bytes:
    name = type(msg).__name__
    if MESSAGE_TYPES.get(name) is not type(msg):
        raise TypeError(f"{name} is not a control message")
    body = {f.name: _plain(getattr(msg, f.name)) for f in dataclasses.fields(msg)}
    return json.dumps({"v": VERSION, "token": token, "type": name, "body": body},
                      separators=(",", ":"), allow_nan=True).encode()


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
    cls = MESSAGE_TYPES.get(envelope.get("type"))
    body = envelope.get("body")
    if cls is None or not isinstance(body, dict):
        raise BadMessage(f"unknown message type {str(envelope.get('type'))[:40]!r}")
    hints = FIELD_TYPES[cls.__name__]
    if not body.keys() <= hints.keys():
        raise BadMessage(f"{cls.__name__} has no fields {sorted(body.keys() - hints.keys())[:5]}")
    try:
        return cls(**{k: _typed(v, hints[k]) for k, v in body.items()})
    except (TypeError, ValueError) as error:
        raise BadMessage(f"{cls.__name__}: {error}") from None


def _plain(value):
    """JSON-ready: NamedTuples as objects of their fields, tuples as arrays, numpy scalars as numbers."""
    if isinstance(value, StepRecord):
        return {k: _plain(v) for k, v in value._asdict().items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        return value.item()
    return value


def _typed(value, hint):
    """Back from JSON to the field's declared shape: StepRecord, and tuples where tuples are declared."""
    origin = typing.get_origin(hint)
    if hint is StepRecord:
        if not isinstance(value, dict):
            raise TypeError("StepRecord must be an object")
        return StepRecord(**{k: _typed(v, RECORD_TYPES[k]) for k, v in value.items() if k in RECORD_TYPES})
    if origin is typing.Union:  # Optional[X]
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        return None if value is None else _typed(value, inner[0]) if len(inner) == 1 else value
    if (hint is tuple or origin is tuple) and isinstance(value, list):
        return tuple(_deep_tuple(v) for v in value)
    if (hint is list or origin is list) and isinstance(value, list):
        return [_deep_tuple(v) for v in value]
    return value


def _deep_tuple(value):
    return tuple(_deep_tuple(v) for v in value) if isinstance(value, list) else value
