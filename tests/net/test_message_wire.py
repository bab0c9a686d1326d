"""The messages that cross hosts: a fixed JSON schema, the run's token on every frame, and
a message port that turns away whatever is not a message of this run (nothing unpickled)."""

from __future__ import annotations

import dataclasses
import math
import os
import pickle
import socket
import time

import pytest
import zmq

from testbed.cluster.layout import plan_on_this_box, plan_ranks
from testbed.control.config import ClusterConfig, device_ref
from testbed.engine.scheduler import StepReport
from testbed.errors import ConfigError
from testbed.metrics.record import StepRecord
from testbed.net import wire
from testbed.net.messages import Audit, Heartbeat, KVPart, Serve, StepEvents, Stop
from testbed.net.rendezvous import World, bind_address, torchrun_world
from testbed.net.transport import Inbox, Outbox, refused_counts
from testbed.perf.hardware import HardwareConfig
from tests.cluster_helpers import read_until

TOKEN = "a" * 32


def step_events() -> StepEvents:
    record = StepRecord(
        1.0, 2.0, "decode_only", 0, 2, 2, 6, 0, 2, 1e-4, 2e-4, 3e-3, 1e-4, 1e-4, ((16, 32),), 80, modelled_s=0.004
    )
    report = StepReport(scheduled=[(3, 1, False)], tokens=[(3, 4, 1234)], finished=[3], handoff=[], hits=[(3, 16)])
    return StepEvents(
        worker=1, t=2.5, record=record, report=report, free_blocks=10, num_running=2, cached=((11, 12), (9,)), sent=2.6
    )


@pytest.mark.parametrize(
    "msg",
    [
        Serve(7, (1, 2, 3), 16, None),
        Serve(8, (4,), 2, 1),
        KVPart(7, 3, (2, 16, 4, 8), "float32", 0, 2),
        Audit(1, 0, 0, 0, 5, {"hits": 2}),
        Stop(),
        wire.Launch(3, {"mode": "disagg", "cluster": {"num_prefill": 1}}),
        wire.Shutdown("ConfigError: bad"),
        step_events(),
    ],
)
def test_every_message_comes_back_as_it_left(msg):
    back = wire.decode(wire.encode(msg, TOKEN), TOKEN)
    assert back == msg and type(back) is type(msg)
    assert isinstance(wire.decode(wire.encode(step_events(), TOKEN), TOKEN).cached, tuple)


def test_a_nan_in_a_step_record_survives():
    record = step_events().record._replace(modelled_s=float("nan"))
    back = wire.decode(wire.encode(dataclasses.replace(step_events(), record=record), TOKEN), TOKEN)
    assert math.isnan(back.record.modelled_s)


@pytest.mark.parametrize(
    "frame, why",
    [
        (b"\x80\x04\x95garbage", "not JSON"),
        (pickle.dumps(Stop()), "not JSON"),
        (b'{"v": 1, "token": "' + TOKEN.encode() + b'", "type": "Stop", "body": {}}', "version"),  # the old one
        (b'{"v": 2, "token": "nope", "type": "Stop", "body": {}}', "token"),
        (b'{"v": 2, "type": "Stop", "body": {}}', "token"),
        (b'{"v": 2, "token": "' + TOKEN.encode() + b'", "type": "Popen", "body": {}}', "unknown message type"),
        (b'{"v": 2, "token": "' + TOKEN.encode() + b'", "type": "Stop", "body": {"cmd": "rm"}}', "no fields"),
        (b'{"v": 2, "token": "' + TOKEN.encode() + b'", "type": "Serve", "body": {"rid": 1}}', "Serve"),
        (b"[1, 2]", "envelope"),
    ],
)
def test_a_frame_that_is_not_a_message_of_this_run_is_refused(frame, why):
    with pytest.raises(wire.BadMessage, match=why):
        wire.decode(frame, TOKEN)


class Evil:
    """Unpickling this would run a command: the message port must never unpickle."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_stray_connections_change_nothing_and_are_logged(tmp_path, caplog):
    ctx = zmq.Context()
    box = Inbox(ctx, "127.0.0.1", TOKEN, 0.5, "rank1")
    port = int(box.address.rsplit(":", 1)[1])
    marker = tmp_path / "pwned"
    with socket.create_connection(("127.0.0.1", port)) as raw:  # not even ZeroMQ: an HTTP probe
        raw.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(range(256)))
    stray = ctx.socket(zmq.PUSH)
    stray.connect(box.address)
    stray.send(pickle.dumps(Evil(marker)))
    stray.send(pickle.dumps(Stop()))
    stray.send(b'{"v": 2, "token": "guess", "type": "Stop", "body": {}}')
    good = Outbox(ctx, box.address, TOKEN, 0.5)
    good.put(Heartbeat(3, 1.0))

    def logged() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "testbed.control"]

    # the probe's handshake event, the stray frames and the good message come over three connections
    # in no fixed order: read until every one of them has been seen, not until a count is reached
    kinds = ("not JSON", "run token", "a connection")  # the last: the HTTP probe, turned away at the handshake
    got = read_until(box, lambda got: got and box.refused >= 4 and all(any(k in m for m in logged()) for k in kinds))
    assert got == [Heartbeat(3, 1.0)]  # the one message of this run, and nothing else
    assert box.refused >= 4 and not marker.exists()
    assert box.refused_by["not JSON"] >= 2 and box.refused_by["wrong or missing run token"] == 1
    assert refused_counts()["rank1"]["not JSON"] >= 2  # the process's tally, for meta.json
    for kind in kinds:
        assert any(kind in line for line in logged()), (kind, logged())
    for sock in (stray,):
        sock.close(linger=0)
    good.close()
    box.close()
    ctx.term()


def test_a_dropped_receiver_is_noticed():
    ctx = zmq.Context()
    box = Inbox(ctx, "127.0.0.1", TOKEN, 0.2, "worker1")
    out = Outbox(ctx, box.address, TOKEN, 0.2)
    out.put(Heartbeat(0, 0.0))
    assert read_until(box, bool) == [Heartbeat(0, 0.0)]
    assert not out.lost()
    box.close()
    deadline = time.monotonic() + 60
    while not out.lost() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert out.lost()
    out.close()
    ctx.term()


def world(world_size=4, per_node=2, rank=0) -> World:
    return World(rank, world_size, rank % per_node, per_node, rank // per_node, "127.0.0.1", 29500, True)


def test_node_device_names_place_workers_on_torchrun_ranks():
    assert device_ref(3) == (0, 3) and device_ref("1:0") == (1, 0)
    cluster = ClusterConfig(num_prefill=2, num_decode=2, prefill_devices=["0:0", "0:1"], decode_devices=["1:0", "1:1"])
    plans = plan_ranks("disagg", cluster, HardwareConfig(name="cpu"), world())
    assert [(p.rank, p.role, p.node) for p in plans] == [
        (0, "prefill_only", 0),
        (1, "prefill_only", 0),
        (2, "decode_only", 1),
        (3, "decode_only", 1),
    ]
    default = plan_ranks("disagg", ClusterConfig(num_prefill=1, num_decode=1), HardwareConfig(name="cpu"), world(2, 1))
    assert [(p.role, p.node) for p in default] == [("prefill_only", 0), ("decode_only", 1)]


@pytest.mark.parametrize(
    "cluster, message",
    [
        (ClusterConfig(num_prefill=1, num_decode=1), "places 2 workers, but torchrun started 4 ranks"),
        (
            ClusterConfig(num_prefill=2, num_decode=2, prefill_devices=["0:0", "0:0"], decode_devices=["1:0", "1:1"]),
            "twice",
        ),
        (
            ClusterConfig(num_prefill=2, num_decode=2, prefill_devices=["0:0", "0:1"], decode_devices=["2:0", "1:1"]),
            "outside 2 nodes x 2 ranks",
        ),
        (ClusterConfig(num_prefill=1, num_decode=1, decode_tp=2), "cluster.decode_tp=2: a tensor-parallel worker"),
    ],
)
def test_a_layout_that_does_not_fill_the_ranks_is_one_line(cluster, message):
    with pytest.raises(ConfigError, match=message):
        plan_ranks("disagg", cluster, HardwareConfig(name="cpu"), world())


def test_one_box_refuses_other_nodes_and_bad_device_names():
    with pytest.raises(ConfigError, match="torchrun"):
        plan_on_this_box(
            "disagg", ClusterConfig(prefill_devices=["0:0"], decode_devices=["1:0"]), HardwareConfig(name="cpu")
        )
    with pytest.raises(ConfigError, match="node:device"):
        ClusterConfig(prefill_devices=["gpu0"]).validate()


def test_torchrun_environment_and_bind_address():
    assert torchrun_world({}) is None
    env = {
        "TORCHELASTIC_RUN_ID": "x",
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_RESTART_COUNT": "2",
    }
    w = torchrun_world(env)
    assert (w.rank, w.node, w.num_nodes, w.agent_store, w.node_of(2), w.scope) == (3, 1, 2, True, 1, "x-2")
    with pytest.raises(ConfigError, match="MASTER_PORT"):
        torchrun_world({k: v for k, v in env.items() if k != "MASTER_PORT"})
    assert bind_address(None, w) == "127.0.0.1"  # two "nodes" that meet on this host's loopback
    with pytest.raises(ConfigError, match="other nodes cannot reach"):  # a hostname that maps to 127.0.1.1 here
        bind_address("127.0.1.1", dataclasses.replace(w, master_addr="gpu-a"))
    with pytest.raises(ConfigError, match="every interface"):
        bind_address("0.0.0.0", w)


def test_a_rank_that_never_joins_fails_the_run_naming_it():
    from testbed.cluster.torchrun import Session
    from testbed.errors import RankLost
    from testbed.ports import free_port

    lonely = World(0, 2, 0, 1, 0, "127.0.0.1", free_port(), agent_store=False)  # rank 1 never starts
    with pytest.raises(RankLost, match=r"rank 1 did not join within 2 s \(cluster.start_timeout_s\)"):
        with Session(lonely, ClusterConfig(start_timeout_s=2.0)):
            pass


def test_message_bench_compares_the_transports():
    from testbed.bench.messages import main

    results = main(["--messages", "20"])
    assert set(results) == {"pipe + pickle (one box)", "zeromq + json (torchrun)", "tcpstore set/get", "gloo send/recv"}
    assert all(r["p99_us"] >= r["p50_us"] > 0 for r in results.values())


def test_worker_times_from_another_host_come_back_on_rank_0s_clock():
    from testbed.net import clocks
    from testbed.net.messages import KVSent

    # the worker's clock runs 1000 s ahead; the quickest of three pings decides (100 us round trip)
    offset = clocks.estimate([(10.0, 1010.004, 10.010), (20.0, 1020.00005, 20.0001), (30.0, 1030.1, 30.3)])
    assert offset.rtt_s == pytest.approx(1e-4) and offset.seconds == pytest.approx(1000.0, abs=1e-4)
    ev = clocks.rebase(step_events(), offset.seconds)
    assert (ev.t, ev.sent, ev.record.start, ev.record.end) == pytest.approx(
        (2.5 - offset.seconds, 2.6 - offset.seconds, 1.0 - offset.seconds, 2.0 - offset.seconds)
    )
    assert ev.record.forward_s == step_events().record.forward_s  # durations are not times
    sent = KVSent(7, 0, 1, 4096, 1005.0, 1005.5, 0.01)
    assert clocks.sender(sent) == 0 and clocks.rebase(sent, 1000.0).start == pytest.approx(5.0)
    assert clocks.rebase(Stop(), 1000.0) == Stop() and clocks.rebase(sent, 0.0) is sent
