"""Per-message latency of the message transports a run across hosts could use, on this machine.

    python -m testbed.bench.messages [--messages 2000]

A router-like process sends a worker's step report (a StepEvents with a batch of tokens) to an echo
process and waits for it to come back; one-way latency is half the round trip. Every transport
does the same work per hop: serialise, move, parse (pickle on the pipe, testbed.net's JSON on the
others). Side by side:
the single-box launcher's pipe (pickle), ZeroMQ with the versioned JSON frames of testbed.net
(what runs under torchrun), torch.distributed's TCPStore (set / blocking get), and gloo send/recv of
the frame's bytes on a CPU group. Each echo runs in its own process, as the workers do.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import time
from datetime import timedelta

import numpy as np

from testbed.engine.scheduler import StepReport
from testbed.metrics.record import StepRecord
from testbed.names import Role
from testbed.net.messages import Started, StepEvents
from testbed.net.rendezvous import host_store, store_client

TOKEN = "b" * 32
WARMUP = 50
TIMEOUT_S = 120  # an echo that died fails the benchmark instead of hanging it


def report(batch: int = 16) -> StepEvents:
    record = StepRecord(
        1.0,
        1.01,
        Role.DECODE_ONLY,
        0,
        batch,
        batch,
        40,
        0,
        batch,
        1e-4,
        2e-4,
        8e-3,
        1e-4,
        3e-4,
        (),
        batch * 300,
        modelled_s=0.01,
    )
    step = StepReport(
        scheduled=[(i, 1, False) for i in range(batch)],
        tokens=[(i, 40, 1000 + i) for i in range(batch)],
        finished=[],
        handoff=[],
        hits=[],
    )
    return StepEvents(worker=1, t=1.01, record=record, report=step, free_blocks=200, num_running=batch, sent=1.011)


def join_gloo(store, rank: int) -> None:
    """This process into the two-rank gloo group whose rendezvous is `store` (the sender's, on the loopback)."""
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", store=dist.PrefixStore("gloo", store), rank=rank, world_size=2, timeout=timedelta(seconds=TIMEOUT_S)
    )


# -- echoes (child processes) ------------------------------------------------------------------
def echo_pipe(conn, count: int) -> None:
    for _ in range(count):
        conn.send(conn.recv())


def echo_zmq(back: str, count: int) -> None:
    import zmq

    from testbed.net.transport import Inbox, Outbox

    ctx = zmq.Context()
    inbox, out = Inbox(ctx, "127.0.0.1", TOKEN, 2.0, "echo"), Outbox(ctx, back, TOKEN, 2.0)
    # the echo's own address: its first message
    out.put(Started(worker=0, role="echo", device="cpu", num_blocks=0, pid=0, host=inbox.address))
    for _ in range(count):
        out.put(inbox.get())
    out.close()
    inbox.close()
    ctx.term()


def echo_store(port: int, count: int) -> None:
    from testbed.net import wire

    store = store_client("127.0.0.1", port, TIMEOUT_S)
    for i in range(count):
        store.set(f"pong/{i}", wire.encode(wire.decode(store.get(f"ping/{i}"), TOKEN), TOKEN))


def echo_gloo(port: int, count: int) -> None:
    import torch
    import torch.distributed as dist

    from testbed.net import wire

    join_gloo(store_client("127.0.0.1", port, TIMEOUT_S), 1)
    size = torch.zeros(1, dtype=torch.int64)
    for _ in range(count):
        dist.recv(size, 0)
        frame = torch.empty(int(size), dtype=torch.uint8)
        dist.recv(frame, 0)
        msg = wire.decode(frame.numpy().tobytes(), TOKEN)
        back = torch.frombuffer(bytearray(wire.encode(msg, TOKEN)), dtype=torch.uint8)
        dist.send(torch.tensor([back.numel()], dtype=torch.int64), 0)
        dist.send(back, 0)
    dist.destroy_process_group()


# -- senders ----------------------------------------------------------------------------------
def time_pipe(count: int) -> list[float]:
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    child = ctx.Process(target=echo_pipe, args=(theirs, count + WARMUP), daemon=True)
    child.start()
    msg, times = report(), []
    for _ in range(count + WARMUP):
        start = time.perf_counter()
        ours.send(msg)
        if not ours.poll(TIMEOUT_S):
            raise RuntimeError("the pipe echo stopped answering")
        ours.recv()
        times.append(time.perf_counter() - start)
    child.join(TIMEOUT_S)
    return times[WARMUP:]


def time_zmq(count: int) -> list[float]:
    import zmq

    from testbed.net.transport import Inbox, Outbox

    zctx = zmq.Context()
    inbox = Inbox(zctx, "127.0.0.1", TOKEN, 2.0, "bench")
    child = mp.get_context("spawn").Process(target=echo_zmq, args=(inbox.address, count + WARMUP), daemon=True)
    child.start()
    hello = inbox.get(timeout=TIMEOUT_S)
    out = Outbox(zctx, hello.host, TOKEN, 2.0)
    msg, times = report(), []
    for _ in range(count + WARMUP):
        start = time.perf_counter()
        out.put(msg)
        inbox.get(timeout=TIMEOUT_S)
        times.append(time.perf_counter() - start)
    child.join(TIMEOUT_S)
    out.close()
    inbox.close()
    zctx.term()
    return times[WARMUP:]


def time_store(count: int) -> list[float]:
    from testbed.net import wire

    store = host_store("127.0.0.1", 0, None, TIMEOUT_S)  # on the loopback alone, as a run's own
    child = mp.get_context("spawn").Process(target=echo_store, args=(store.port, count + WARMUP), daemon=True)
    child.start()
    msg, times = report(), []
    for i in range(count + WARMUP):
        start = time.perf_counter()
        store.set(f"ping/{i}", wire.encode(msg, TOKEN))
        wire.decode(store.get(f"pong/{i}"), TOKEN)
        times.append(time.perf_counter() - start)
    child.join(TIMEOUT_S)
    return times[WARMUP:]


def time_gloo(count: int) -> list[float]:
    import torch
    import torch.distributed as dist

    from testbed.net import wire

    store = host_store("127.0.0.1", 0, None, TIMEOUT_S)  # the group's rendezvous, on the loopback alone
    child = mp.get_context("spawn").Process(target=echo_gloo, args=(store.port, count + WARMUP), daemon=True)
    child.start()
    join_gloo(store, 0)
    times = []
    for _ in range(count + WARMUP):
        start = time.perf_counter()
        frame = torch.frombuffer(bytearray(wire.encode(report(), TOKEN)), dtype=torch.uint8)
        size = torch.tensor([frame.numel()], dtype=torch.int64)
        dist.send(size, 1)
        dist.send(frame, 1)
        dist.recv(size, 1)
        back = torch.empty(int(size), dtype=torch.uint8)
        dist.recv(back, 1)
        wire.decode(back.numpy().tobytes(), TOKEN)
        times.append(time.perf_counter() - start)
    dist.destroy_process_group()
    child.join(TIMEOUT_S)
    return times[WARMUP:]


TRANSPORTS = {
    "pipe + pickle (one box)": time_pipe,
    "zeromq + json (torchrun)": time_zmq,
    "tcpstore set/get": time_store,
    "gloo send/recv": time_gloo,
}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=2000)
    args = parser.parse_args(argv)
    from testbed.net import wire

    print(f"one step report: {len(wire.encode(report(), TOKEN))} bytes of JSON; {args.messages} round trips each")
    print(f"{'transport':28s} {'one-way p50 us':>15s} {'p99 us':>9s}")
    results = {}
    for name, timer in TRANSPORTS.items():
        one_way = np.array(timer(args.messages)) / 2 * 1e6
        results[name] = {"p50_us": float(np.percentile(one_way, 50)), "p99_us": float(np.percentile(one_way, 99))}
        print(f"{name:28s} {results[name]['p50_us']:15.0f} {results[name]['p99_us']:9.0f}")
    return results


if __name__ == "__main__":
    main()
