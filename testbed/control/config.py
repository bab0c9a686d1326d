"""Cluster and KV-transfer settings: which workers exist, where they run, how KV moves. The control
plane's configuration: the real cluster and the simulator read the same one."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional

from testbed.control.handoff import HandoffRule, Link, Mechanism, network_of
from testbed.errors import ConfigError
from testbed.names import Binding, Granularity, Kind, KVBackend, Multiturn, OnFailure

DISPATCH = ("round_robin", "least_loaded", "session_affinity", "kv_aware")
TP_KEYS = {Kind.MIXED: "tp", Kind.PREFILL: "prefill_tp", Kind.DECODE: "decode_tp"}  # a worker kind's TP degree


@dataclass(frozen=True)
class ClusterConfig:
    """colocated / chunked: `num_workers` mixed workers. disagg: `num_prefill` P + `num_decode` D
    workers. Devices: P on the first devices and D on the next unless given explicitly; a worker of
    tensor-parallel degree tp takes tp consecutive devices (executor=sim only, so far)."""

    num_workers: int = 1  # mixed workers (colocated, chunked)
    num_prefill: int = 1  # prefill (P) workers (disagg)
    num_decode: int = 1  # decode (D) workers (disagg)
    tp: int = 1  # tensor-parallel degree of each mixed worker (colocated, chunked): the devices it spans
    prefill_tp: int = 1  # tensor-parallel degree of each prefill (P) worker (disagg): the devices it spans
    decode_tp: int = 1  # tensor-parallel degree of each decode (D) worker (disagg): the devices it spans
    # a device index (this node), or "node:device" under torchrun across hosts ("1:0": node 1's first GPU)
    prefill_devices: Optional[List[Any]] = None
    decode_devices: Optional[List[Any]] = None  # D workers' devices, as prefill_devices; None: the devices after P's
    dispatch: str = "round_robin"  # requests to mixed / prefill workers
    decode_dispatch: str = "least_loaded"  # KV to decode workers (late binding, or at arrival when early)
    kv_aware_load_weight: float = 1.0  # kv_aware: cached prompt tokens worth one token of load
    # routing by input length: prompts of at least this many tokens go to long_prompt_workers
    # (front ranks), shorter ones to the other front workers; None: off
    long_prompt_min_tokens: Optional[int] = None
    long_prompt_workers: List[int] = field(default_factory=list)  # front worker ranks (mixed or P) for long prompts
    max_prompt_len: Optional[int] = None  # admission control: longer prompts are rejected
    max_outstanding: Optional[int] = None  # admission control: requests in the system at once
    start_timeout_s: float = 300.0  # workers up and process group formed
    # a worker silent for 5 heartbeats whose process is alive is slow: counted, not failed
    heartbeat_s: float = 2.0
    on_worker_failure: str = "fail"  # fail | redispatch: what becomes of a lost worker's requests
    # no report from any worker for this long: the rest fails; one worker silent this long (and at
    # least 5 heartbeats) with its process alive is lost as hung
    stall_timeout_s: float = 120.0
    # under torchrun: the address this host's control sockets listen on (None: the interface that
    # reaches the rendezvous host; every-interface addresses are refused)
    bind: Optional[str] = None
    # CPU workers' niceness, 0-19 (cuda workers keep the launcher's). Higher yields the cores to the
    # router (quiet, no measurable gain) and to everything else: at 19 a worker beside a busy process
    # gets ~1.5% of a core (a tiny study took 259 s against 11 s at 0; docs/statistics.md)
    cpu_worker_nice: int = 0

    def num_devices(self, disagg: bool) -> int:
        """The devices the workers span, each worker its TP degree (explicit device maps aside)."""
        if disagg:
            return self.num_prefill * self.prefill_tp + self.num_decode * self.decode_tp
        return self.num_workers * self.tp

    def tp_of(self, kind: str) -> int:
        """The tensor-parallel degree of a worker of this kind (mixed, prefill, decode)."""
        return getattr(self, TP_KEYS[kind])

    @property
    def kv_aware(self) -> bool:
        """Some dispatch follows the workers' prefix caches (which must then be on)."""
        return "kv_aware" in (self.dispatch, self.decode_dispatch)

    def validate(self) -> "ClusterConfig":
        for key in ("num_workers", "num_prefill", "num_decode", *TP_KEYS.values()):
            if getattr(self, key) < 1:
                raise ConfigError(f"cluster.{key} must be >= 1 (got {getattr(self, key)})")
        if not 0 <= self.cpu_worker_nice <= 19:
            raise ConfigError(f"cluster.cpu_worker_nice must be an integer in 0..19 (got {self.cpu_worker_nice})")
        for key in ("dispatch", "decode_dispatch"):
            if getattr(self, key) not in DISPATCH:
                raise ConfigError(f"cluster.{key}={getattr(self, key)!r} is not one of {', '.join(DISPATCH)}")
        if (self.long_prompt_min_tokens is None) != (not self.long_prompt_workers):
            raise ConfigError(
                "cluster.long_prompt_min_tokens and cluster.long_prompt_workers go together "
                f"(got {self.long_prompt_min_tokens} and {list(self.long_prompt_workers)})"
            )
        if self.long_prompt_min_tokens is not None and self.long_prompt_min_tokens < 1:
            raise ConfigError(f"cluster.long_prompt_min_tokens must be >= 1 (got {self.long_prompt_min_tokens})")
        if self.kv_aware_load_weight < 0:
            raise ConfigError(f"cluster.kv_aware_load_weight must be >= 0 (got {self.kv_aware_load_weight})")
        if self.stall_timeout_s <= 0 or self.heartbeat_s <= 0:
            raise ConfigError(
                f"cluster.stall_timeout_s and cluster.heartbeat_s must be > 0 "
                f"(got {self.stall_timeout_s}, {self.heartbeat_s})"
            )
        if self.on_worker_failure not in ("fail", "redispatch"):
            raise ConfigError(f"cluster.on_worker_failure={self.on_worker_failure!r} is not one of fail, redispatch")
        for key in ("prefill_devices", "decode_devices"):
            for entry in getattr(self, key) or ():
                device_ref(entry, f"cluster.{key}")
        for key in ("max_prompt_len", "max_outstanding"):
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise ConfigError(f"cluster.{key} must be >= 1 when set (got {getattr(self, key)})")
        return self


def device_ref(entry, key: str = "cluster.prefill_devices") -> tuple[int, int]:
    """(node, device) of a device entry: 3 is (0, 3); "1:0" is (1, 0)."""
    text = str(entry).strip()
    node, _, device = text.rpartition(":")
    try:
        ref = (int(node) if node else 0, int(device))
    except ValueError:
        ref = (-1, -1)
    if min(ref) < 0 or isinstance(entry, bool):
        raise ConfigError(f"{key} entry {entry!r} is not a device index (3) or node:device (1:0)")
    return ref


# the KV failure settings' defaults: kv_transfer's, and the policy's it hands the workers (one set).
# A config's defaults are the plain strings (`.value`): config.yaml is written with yaml.safe_dump.
ON_FAILURE, MAX_RETRIES, RETRY_FALLBACK = OnFailure.FAIL.value, 2, OnFailure.RECOMPUTE.value
# kv_transfer.backend: a value's old name (results written before its rename still read) -> its name
RENAMED_BACKENDS = {"auto": KVBackend.PROCESS_GROUP.value}


@dataclass(frozen=True)
class KVFailurePolicy:
    """What the decode worker does when an attempt to move a request's KV fails
    (KVTransferConfig.failure_policy: kv_transfer's three settings)."""

    on_failure: str = ON_FAILURE
    max_retries: int = MAX_RETRIES
    retry_fallback: str = RETRY_FALLBACK

    def after(self, attempt: int) -> str:
        """`retry`, `recompute` or `fail` once attempt number `attempt` (from 1) has failed."""
        if self.on_failure != OnFailure.RETRY:
            return self.on_failure
        return OnFailure.RETRY if attempt <= self.max_retries else self.retry_fallback

    @property
    def holds_until_ack(self) -> bool:
        """P keeps the KV until D acknowledges it, so that it can send it again."""
        return self.on_failure == OnFailure.RETRY


@dataclass(frozen=True)
class KVTransferConfig:
    granularity: str = Granularity.REQUEST.value  # request: one message after prefill; layer: one per layer, streamed
    # when the decode worker is bound: late, when prefill ends; early, at arrival (D pre-allocates).
    # Formerly kv_transfer.binding (a name too near cluster.bind, an address)
    decode_binding: str = Binding.LATE.value
    # a lease: it starts when P begins to send an attempt and every arriving piece renews it; an
    # attempt silent for this long has failed (D's reservation while P queues is not timed)
    timeout_s: float = 30.0
    on_failure: str = ON_FAILURE  # fail | recompute (D runs the prefill itself) | retry (P sends again)
    max_retries: int = MAX_RETRIES  # on_failure=retry: resends after the first attempt
    retry_fallback: str = RETRY_FALLBACK  # on_failure=retry, every resend failed: recompute | fail
    max_pending: int = 8  # P's bounded queue of prefilled requests whose KV waits for D
    piece_kib: int = 8192  # a part larger than this travels as pieces, so packing overlaps the wire
    # a session's later turns: resend (through P, the whole prompt's KV again), incremental (through
    # P, which sends only the blocks D's cache lacks) or ppd (straight to the decode worker whose
    # cache holds the most of the prompt, which prefills only the rest)
    multiturn: str = Multiturn.RESEND.value
    ppd_max_append_tokens: int = 512  # ppd: a longer uncached part goes through P
    local_prefill_max_tokens: int = 0  # prompts (or uncached parts) this short prefill on D; 0: off
    # how the KV moves: process_group (torch.distributed's process group: NCCL between GPUs, gloo on
    # CPU) or ipc (P writes into D's blocks through D's mapped pool: one box; P and D may share one GPU)
    backend: str = KVBackend.PROCESS_GROUP.value
    # how a connector's hand-off is timed by the simulator and the emulation (testbed/control/handoff.py):
    # send (one packed message after the prefill), pull (NIXL: D reads P's blocks after the prefill,
    # a descriptor per layer, block, K and V) or push_layerwise (P2pNccl, Mooncake, LMCache: each
    # layer as its prefill ends, overlapping the prefill)
    mechanism: str = Mechanism.SEND.value
    # pull, push_layerwise: the cost of one block descriptor. 3.5 us: vLLM #50913 cut a ~5k-token
    # NIXL pull's window by ~58 ms going from 16- to 64-token blocks, ~16.8k fewer descriptors at 36 layers
    descriptor_cost_s: float = 3.5e-6
    # the decode side's fixed path from the KV landing to its first token (0: the testbed's engine;
    # vLLM's NIXL P/D measured ~197 ms p50 of which the transfer was ~29 ms: vLLM PR #51919)
    first_token_path_s: float = 0.0
    # the hand-off's link: auto (the device link inside a node, hardware.internode_gbps between
    # nodes), nvlink (the same, refused across nodes), rdma or tcp (every hand-off crosses that network)
    link: str = Link.AUTO.value
    link_gbps: Optional[float] = None  # rdma, tcp: the network's GB/s (bytes); None: 45 (rdma), 10 (tcp)
    link_latency_s: Optional[float] = None  # rdma, tcp: its latency per transfer; None: 5 us (rdma), 50 us (tcp)

    def handoff_rule(self, layers: int, block_size: int) -> HandoffRule:
        """The hand-off's timing rule for a model of `layers` layers in blocks of `block_size`."""
        return HandoffRule(self.mechanism, self.descriptor_cost_s, self.first_token_path_s, layers, block_size)

    @property
    def network(self) -> Optional[tuple[float, float]]:
        """(GB/s, latency s) of the network every hand-off crosses (link=rdma|tcp); None: the device link."""
        return network_of(self.link, self.link_gbps, self.link_latency_s)

    @property
    def follows_caches(self) -> bool:
        """Some routing rule of the hand-off asks where prompts are cached."""
        return self.multiturn != Multiturn.RESEND or self.local_prefill_max_tokens > 0

    @property
    def piece_bytes(self) -> int:
        return self.piece_kib << 10

    @property
    def incremental(self) -> bool:
        """D reserves onto its cached prefix and P sends only the rest."""
        return self.multiturn == Multiturn.INCREMENTAL

    @property
    def direct(self) -> bool:
        """ipc: P writes into D's mapped pool, no KV over the process group."""
        return self.backend == KVBackend.IPC

    def prefills_on_decode(self, turn: int, prompt_tokens: int, cached_tokens: int) -> bool:
        """Whether a decode worker whose cache holds `cached_tokens` of the prompt prefills the
        request itself, with no transfer: a short uncached part (conditional disaggregation),
        or a later turn's append onto the session's KV it still holds (PPD)."""
        uncached = prompt_tokens - cached_tokens
        if self.local_prefill_max_tokens > 0 and uncached <= self.local_prefill_max_tokens:
            return True  # 0 turns it off, for a fully cached prompt (nothing uncached) too
        ppd = self.multiturn == Multiturn.PPD
        return ppd and turn > 0 and cached_tokens > 0 and uncached <= self.ppd_max_append_tokens

    def failure_policy(self) -> KVFailurePolicy:
        return KVFailurePolicy(self.on_failure, self.max_retries, self.retry_fallback)

    def validate(self) -> "KVTransferConfig":
        choices = {
            "granularity": tuple(Granularity),
            "decode_binding": tuple(Binding),
            "on_failure": tuple(OnFailure),
            "retry_fallback": (OnFailure.RECOMPUTE, OnFailure.FAIL),
            "multiturn": tuple(Multiturn),
            "backend": tuple(KVBackend),
            "mechanism": tuple(Mechanism),
            "link": tuple(Link),
        }
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                raise ConfigError(f"kv_transfer.{key}={getattr(self, key)!r} is not one of {', '.join(allowed)}")
        if self.granularity == Granularity.LAYER and self.decode_binding != Binding.EARLY:
            raise ConfigError(
                "kv_transfer.granularity=layer needs kv_transfer.decode_binding=early "
                "(D must have blocks before the prefill streams into them)"
            )
        for key in ("ppd_max_append_tokens", "local_prefill_max_tokens"):
            if getattr(self, key) < 0:
                raise ConfigError(f"kv_transfer.{key} must be >= 0 (got {getattr(self, key)})")
        for key in ("descriptor_cost_s", "first_token_path_s"):
            if getattr(self, key) < 0:
                raise ConfigError(f"kv_transfer.{key} must be >= 0 (got {getattr(self, key)})")
        if self.link_gbps is not None and self.link_gbps <= 0 or (self.link_latency_s or 0) < 0:
            raise ConfigError(
                f"kv_transfer.link_gbps must be > 0 and kv_transfer.link_latency_s >= 0 when set "
                f"(got {self.link_gbps}, {self.link_latency_s})"
            )
        if self.network is None and (self.link_gbps, self.link_latency_s) != (None, None):
            raise ConfigError(
                f"kv_transfer.link_gbps and link_latency_s set a network's rate: kv_transfer.link="
                f"{self.link} has none (use rdma or tcp; between nodes hardware.internode_gbps)"
            )
        if self.piece_kib < 1:
            raise ConfigError(f"kv_transfer.piece_kib must be >= 1 (got {self.piece_kib})")
        if self.max_retries < 0:
            raise ConfigError(f"kv_transfer.max_retries must be >= 0 (got {self.max_retries})")
        if self.timeout_s <= 0 or self.max_pending < 1:
            raise ConfigError(
                f"kv_transfer.timeout_s must be > 0 and kv_transfer.max_pending >= 1 "
                f"(got {self.timeout_s}, {self.max_pending})"
            )
        return self
