"""What the HTTP path adds: python -m testbed.server.bench [--mode chunked] [--requests 60] [--rate 8] [--repeats 3]

The same workload (same seeds) served in-process and replayed over HTTP against the same
configuration behind `python -m testbed.serve_http`'s server, repeat by repeat. Prints TTFT and
TPOT p50/p99 for both with 95% intervals, their ratio (HTTP / in-process) with its interval,
"not separated" when the ratio's interval holds 1, and whether every request got the same tokens.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

from testbed.config import Config, with_overrides
from testbed.metrics.uncertainty import ratio_interval, sample_interval

LAYOUTS = {
    "colocated": {"mode": "colocated", "cluster.num_workers": 1},
    "chunked": {"mode": "chunked", "cluster.num_workers": 1},
    "disagg": {"mode": "disagg", "cluster.num_prefill": 1, "cluster.num_decode": 1},
}


def config(mode: str, requests: int, rate: float, seed: int) -> Config:
    return with_overrides(
        Config(),
        {
            **LAYOUTS[mode],
            "hardware.name": "cpu",
            "seed": seed,
            "http.port": 0,
            "workload.num_requests": requests,
            "workload.rate": rate,
        },
    )


def one_repeat(cfg: Config, root: Path) -> tuple:
    """(in-process requests, HTTP requests) of one seed."""
    from testbed.server.app import HttpServer
    from testbed.studies.executors import http_point
    from testbed.studies.real_cluster import serve

    local = serve(cfg, root / "local", progress=False)["requests"]
    with HttpServer(cfg) as server:
        client = with_overrides(cfg, {"executor": "http", "http.url": server.url})
        remote = http_point(client, root / "http", progress=False)["requests"]
    return local, remote


def row(metric: str, stat: str, local: list[np.ndarray], remote: list[np.ndarray]) -> str:
    """One figure: each side's runs pooled with an interval over the runs, and the ratio paired by seed."""
    a, b = (sample_interval(x, stat) for x in (local, remote))
    ratio = ratio_interval(remote, local, stat)
    if not ratio.known:
        verdict = f"no interval ({ratio.note or 'one repeat'})"
    else:
        verdict = (
            "not separated" if ratio.low <= 1 <= ratio.high else ("HTTP slower" if ratio.low > 1 else "HTTP faster")
        )
    ms = lambda i: f"{1000 * i.estimate:8.2f} [{1000 * i.low:.2f}, {1000 * i.high:.2f}]"  # noqa: E731
    return (
        f"{metric + ' ' + stat:10} {ms(a)}  {ms(b)}  {ratio.estimate:5.2f} [{ratio.low:.2f}, {ratio.high:.2f}]  "
        f"{verdict}"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=sorted(LAYOUTS), default="chunked")
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--rate", type=float, default=8.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    pairs = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.repeats):
            print(f"repeat {seed + 1}/{args.repeats}: in-process, then over HTTP", flush=True)
            pairs.append(one_repeat(config(args.mode, args.requests, args.rate, seed), Path(tmp) / str(seed)))
    same = sum(
        sum(a == b for a, b in zip(l.output_token_ids.map(list), r.output_token_ids.map(list))) for l, r in pairs
    )
    total = sum(len(l) for l, _ in pairs)
    print(f"\nmode={args.mode}, {args.repeats} x {args.requests} requests at {args.rate:g} req/s; times in ms")
    print(f"{'':10} {'in-process':>8} [95% interval]  {'HTTP':>8} [95% interval]  ratio [95% interval]")
    for metric in ("ttft", "tpot"):
        local = [l.loc[l.status == "ok", metric].to_numpy(float) for l, _ in pairs]  # one array per seed
        remote = [r.loc[r.status == "ok", metric].to_numpy(float) for _, r in pairs]
        for stat in ("p50", "p99"):
            print(row(metric, stat, local, remote))
    print(f"same tokens: {same} of {total} requests")
    return 0 if same == total else 1


if __name__ == "__main__":
    raise SystemExit(main())
