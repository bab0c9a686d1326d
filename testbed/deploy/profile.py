"""`+experiment=profile executor=vllm`: vLLM's steps measured through its own metrics, written as a
profile the simulator runs on (the same file as the testbed engine's profile: step samples, KV
transfer samples, the fitted cost model), plus the front end a client sees and the engine does not.

    prefill   one request of L tokens on an idle instance: the engine's prefill time
              (vllm:request_prefill_time_seconds), one step of L new tokens
    decode    B requests at once: the mean inter-token latency over their decode
              (vllm:inter_token_latency_seconds), steps of B sequences at the mean context
    transfer  a 1P1D request of L tokens: NIXL's own time and bytes (vllm:nixl_*), as the link
    front end the client's TTFT of an idle request less the engine's queue and prefill time
"""

from __future__ import annotations

import json
import statistics
import threading
import time
import urllib.request
from dataclasses import asdict

from testbed.deploy import prometheus
from testbed.deploy.deployment import Deployments, Shape
from testbed.names import Kind, Mode
from testbed.perf.attention import attended_context
from testbed.perf.measured import fit_profile

PREFILL_LENGTHS = (16, 64, 128, 256, 512, 1024, 1536)
DECODE_BATCHES = (1, 2, 4, 8, 16)
DECODE_PROMPTS = (64, 512)
DECODE_TOKENS = 48
TRANSFER_LENGTHS = (64, 256, 1024)
REPEATS = 3


def profile_vllm(pool: Deployments, quick: bool = False) -> dict:
    """The profile dict (JSON-ready) of the pool's model: one colocated instance measured, then a
    1P1D pair for the KV link."""
    from testbed.control.config import ClusterConfig
    from testbed.model.config import ModelConfig

    args = ModelConfig(name="hf", path=pool.model).args()
    served, vocab = pool.vllm.served_name, args.vocab_size
    one = pool.get(Shape.of(Mode.COLOCATED, ClusterConfig(num_workers=1), 0, False))
    client = Client(one.of(Kind.MIXED)[0].spec.url, served, vocab)
    started = time.perf_counter()
    repeats = 1 if quick else REPEATS
    steps, front = [], []
    for length in PREFILL_LENGTHS[::2] if quick else PREFILL_LENGTHS:
        for _ in range(repeats):
            seconds, frontend = client.prefill(length)
            steps.append(_row(length, attended_context([(length, 0)]), 0, 0, seconds))
            front.append(frontend)
    for prompt in DECODE_PROMPTS:
        for batch in DECODE_BATCHES[:3] if quick else DECODE_BATCHES:
            seconds = client.decode(batch, prompt, DECODE_TOKENS)
            steps.append(_row(0, 0.0, batch, batch * (prompt + DECODE_TOKENS // 2), seconds))
    transfers = []
    disagg = pool.get(Shape.of(Mode.DISAGG, ClusterConfig(num_prefill=1, num_decode=1), 0, False))
    pair = (disagg.of(Kind.PREFILL)[0].spec.url, disagg.of(Kind.DECODE)[0].spec.url)
    for length in TRANSFER_LENGTHS:
        for _ in range(repeats):
            transfers.append(Client(pair[1], served, vocab).transfer(pair[0], length))
    profile = {
        "version": 1,
        "model_name": "hf",
        "model": asdict(args),
        "device": "cpu",
        "device_name": f"vllm on {pool.host.device}",
        "engine": "vllm",
        "dtype": "float32",
        "dtype_bytes": 4,
        "block_size": 16,
        "attention_backend": "vllm",
        "causal_attention": True,
        "transfer_source": "nixl",
        "quick": quick,
        "samples": {"step": steps, "transfer": transfers},
        "frontend_latency_s": statistics.median(front),
        # the hand-off beyond the transfer: the decode request's hop, its wait for the pull, the last
        # token's step (the simulator's sim.handoff_latency_s)
        "handoff_latency_s": statistics.median(max(0.0, t["handoff_s"] - t["seconds"]) for t in transfers),
        "profile_s": time.perf_counter() - started,
    }
    profile["cost_model"], profile["fit"] = fit_profile(profile)
    return profile


def _row(prefill_tokens, prefill_context, decode_seqs, decode_context, seconds) -> dict:
    return {
        "prefill_tokens": prefill_tokens,
        "prefill_context": prefill_context,
        "decode_seqs": decode_seqs,
        "decode_context": decode_context,
        "seconds": seconds,
    }


class Client:
    """Requests to one instance, and the instance's metrics around them."""

    def __init__(self, url: str, served: str, vocab: int):
        self.url, self.served, self.vocab = url, served, vocab
        self.drawn = 0  # prompts differ from each other: no prefix-cache hit between samples

    def prompt(self, length: int) -> list[int]:
        self.drawn += 1
        return [(self.drawn * 7919 + i * 104729) % (self.vocab - 10) + 5 for i in range(length)]

    def post(self, body: dict, url: str | None = None) -> dict:
        data = json.dumps({"model": self.served, "temperature": 0.0, "ignore_eos": True, **body}).encode()
        request = urllib.request.Request(
            (url or self.url) + "/v1/completions", data=data, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=600) as response:
            return json.loads(response.read())

    def metrics(self, url: str | None = None) -> prometheus.Scrape:
        with urllib.request.urlopen((url or self.url) + "/metrics", timeout=30) as response:
            return prometheus.parse(response.read(prometheus.MAX_BYTES).decode(errors="replace"))

    def prefill(self, length: int) -> tuple[float, float]:
        """(the engine's prefill seconds, the front end's: client TTFT less queue and prefill)."""
        before = self.metrics()
        sent = time.perf_counter()
        self.post({"prompt": self.prompt(length), "max_tokens": 1})
        client = time.perf_counter() - sent
        figures = prometheus.point_figures(before, self.metrics(), [])
        prefill, queue = figures["prefill_s"]["mean"], figures["queue_s"]["mean"] or 0.0
        return prefill, max(0.0, client - prefill - queue)

    def decode(self, batch: int, prompt: int, tokens: int) -> float:
        """The mean inter-token latency of `batch` requests decoding together."""
        before = self.metrics()
        bodies = [{"prompt": self.prompt(prompt), "max_tokens": tokens, "min_tokens": tokens} for _ in range(batch)]
        threads = [threading.Thread(target=self.post, args=(body,)) for body in bodies]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        after = self.metrics()
        count = after.total("vllm:inter_token_latency_seconds_count") - before.total(
            "vllm:inter_token_latency_seconds_count"
        )
        total = after.total("vllm:inter_token_latency_seconds_sum") - before.total(
            "vllm:inter_token_latency_seconds_sum"
        )
        return total / count

    def transfer(self, prefill_url: str, length: int) -> dict:
        """One P/D hand-off of `length` tokens: NIXL's bytes and seconds on the decode instance, and
        the whole hand-off (the decode request's first token after the prefill's answer) beside it."""
        from testbed.deploy.router import REMOTE_DECODE

        before = self.metrics()
        prompt = self.prompt(length)
        answer = self.post({"prompt": prompt, "max_tokens": 1, "kv_transfer_params": REMOTE_DECODE}, prefill_url)
        sent = time.perf_counter()
        self.post({"prompt": prompt, "max_tokens": 1, "kv_transfer_params": answer["kv_transfer_params"]})
        handoff = time.perf_counter() - sent
        figures = prometheus.point_figures(before, self.metrics(), [])
        seconds = figures["kv_transfer_s"]["mean"]
        return {"bytes": figures["kv_transfer_bytes"], "seconds": seconds, "handoff_s": handoff}
