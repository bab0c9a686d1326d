"""A worker's error reaches a router that may already be gone without a word of its own: every
worker finds the same bad input, the router ends the run on the first report and closes its
pipes, and a later worker's report must not add a traceback to the run's one line."""

import signal
import sys
from multiprocessing import Pipe
from types import SimpleNamespace

import pytest

from testbed.cluster import worker
from testbed.errors import ConfigError, PeerLost
from testbed.net.channel import ReportWriter
from testbed.net.messages import WorkerError

SPEC = SimpleNamespace(rank=1, groups=None)


@pytest.mark.parametrize("error", [ConfigError("bad input"), PeerLost("peer gone"), RuntimeError("bug")])
def test_an_error_for_a_router_that_has_gone_is_dropped_quietly(monkeypatch, capsys, error):
    def setup(spec):
        raise error

    monkeypatch.setattr(worker, "_setup", setup)
    # what the worker's process sets for itself, kept from this one
    monkeypatch.setattr(signal, "signal", lambda *args: None)
    monkeypatch.setattr(sys, "setswitchinterval", lambda interval: None)
    reader, writer = Pipe(duplex=False)
    reader.close()  # the router ended the run on another worker's report
    worker.worker_main(SPEC, None, ReportWriter(writer))
    captured = capsys.readouterr()
    assert captured.out == captured.err == ""


def test_an_error_for_a_router_that_listens_arrives_once():
    reader, writer = Pipe(duplex=False)
    worker._tell(ReportWriter(writer), WorkerError(1, "bad input", bad_input=True))
    message = reader.recv()
    assert isinstance(message, WorkerError) and message.worker == 1 and message.bad_input
