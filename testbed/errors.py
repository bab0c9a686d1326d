"""Errors the command line reports as one line and a non-zero exit, not a traceback."""


class TestbedError(Exception):
    """Bad input: the message names what is wrong and what is allowed."""

    exit_code = 2


class ConfigError(TestbedError, ValueError):
    """A configuration value is out of range or inconsistent."""


class PeerLost(TestbedError):
    """Under torchrun: a process this one sends messages to is gone or unreachable."""

    exit_code = 1


class RankLost(PeerLost):
    """Under torchrun: a rank died, never joined, or lost its connection; the run cannot go on."""


class KVLeakError(RuntimeError):
    """A worker ended the run with KV blocks or KV staging buffers still allocated."""


class StateError(RuntimeError):
    """A status change its state machine does not have (a bug in the caller, not bad input)."""
