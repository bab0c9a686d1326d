"""How a connector hands a request's KV from P to D, as times: the one rule the simulator and the
emulated cluster both follow. No clock: callers pass the link's time for a byte count and offsets
from the prefill's end.

kv_transfer.mechanism:
  send            the testbed's own connector: after the prefill P sends the KV packed into one
                  message: link(bytes). The default; what every result before the other two had.
  pull            NIXL-style (vLLM's NixlConnector): after the prefill D reads P's blocks, one
                  descriptor per layer, block and K or V: link(bytes) + descriptor_cost_s x
                  layers x blocks x 2. A 5,000-token prompt of a 32-layer model in 16-token
                  blocks is 32 x 313 x 2 = 20,032 descriptors; in 128-token blocks, 2,560.
  push_layerwise  P2pNccl / Mooncake / LMCache-style: each layer's KV leaves as soon as that layer's
                  prefill is done, overlapping the prefill. One layer's send is s = link(bytes / L)
                  + its 1/L of the descriptors; layer k (0-based, of L) is ready (k + 1) W / L into a
                  prefill of W seconds, and the link takes one send at a time from `link_from`, so
                  the last layer lands  max(s, L s - (L - 1) W / L, link_from + L s)  after the
                  prefill's end: one layer's send when the link keeps up (s <= W / L), plus what the
                  overlap could not hide when it does not.
D may decode first_token_path_s after the KV has landed (the decode side's fixed first-token path).

kv_transfer.link: `auto` (the cost model's device link inside a node, NVLink on an analytical GPU,
hardware.internode_gbps between nodes), `nvlink` (the same, refused across nodes), `rdma` or `tcp`
(every hand-off crosses that network, at NETWORKS' figures unless link_gbps / link_latency_s say).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from testbed.names import StrEnum

KV_PLANES = 2  # K and V: separate regions of a layer's cache, so separate descriptors (not MLA)


class Mechanism(StrEnum):
    SEND = "send"
    PULL = "pull"
    PUSH_LAYERWISE = "push_layerwise"


class Link(StrEnum):
    AUTO = "auto"
    NVLINK = "nvlink"
    RDMA = "rdma"
    TCP = "tcp"


# (GB/s in bytes, latency s) of the named networks. rdma: one 400 Gb/s ConnectX-7 NIC per GPU (NVIDIA
# DGX H100 user guide: eight, one per GPU), 50 GB/s on the wire, of which an RDMA write of MB-sized
# messages reaches about 90% (ib_write_bw); a few us to post and complete one. tcp: a 100 GbE NIC
# (12.5 GB/s) at about 80% through the kernel's TCP stack, and the tens of us of its round trip
# (Mooncake's TCP transport, NIXL's UCX over TCP). Datasheet-level figures: measure and override.
NETWORKS = {Link.RDMA: (45.0, 5e-6), Link.TCP: (10.0, 50e-6)}


@dataclass(frozen=True)
class Leg:
    """One hand-off in seconds from the prefill's end: the link holds it from `start` to `end`;
    D may decode from `ready` (end + the first-token path)."""

    start: float
    end: float
    ready: float


@dataclass(frozen=True)
class HandoffRule:
    """kv_transfer's mechanism knobs with the model's layers and the engine's block size."""

    mechanism: str = Mechanism.SEND.value
    descriptor_cost_s: float = 0.0
    first_token_path_s: float = 0.0
    layers: int = 1
    block_size: int = 16

    def descriptors(self, tokens: int) -> int:
        """Block descriptors of a pull of `tokens` tokens (per rank: every rank holds every layer)."""
        return self.layers * -(-int(tokens) // self.block_size) * KV_PLANES

    def descriptor_s(self, tokens: int) -> float:
        """Their cost; `send` packs the KV into one message and pays none."""
        if self.mechanism == Mechanism.SEND:
            return 0.0
        return self.descriptor_cost_s * self.descriptors(tokens)

    @property
    def layerwise(self) -> bool:
        return self.mechanism == Mechanism.PUSH_LAYERWISE

    def busy_s(self, link: Callable[[float], float], nbytes: float, tokens: int) -> float:
        """send and pull: how long the whole request holds the link, after the prefill."""
        return link(nbytes) + self.descriptor_s(tokens)

    def layer_send_s(self, link: Callable[[float], float], nbytes: float, tokens: int) -> float:
        """push_layerwise: one layer's send, its share of the bytes and the descriptors."""
        return link(nbytes / self.layers) + self.descriptor_s(tokens) / self.layers

    def leg(
        self,
        link: Callable[[float], float],
        nbytes: float,
        tokens: int,
        prefill_s: float = 0.0,
        link_from_s: float = 0.0,
    ) -> Leg:
        """The hand-off of `nbytes` (`tokens` tokens) whose prefill took `prefill_s`, the link free
        for it from `link_from_s` (from the prefill's end; negative: free while it ran)."""
        if self.layerwise:
            send = self.layer_send_s(link, nbytes, tokens)
            start = max(link_from_s, -prefill_s + prefill_s / self.layers)  # layer 0's KV is ready
            end = layerwise_end(prefill_s, self.layers, send, link_from_s)
        else:
            start = max(link_from_s, 0.0)
            end = start + self.busy_s(link, nbytes, tokens)
        return Leg(start, end, end + self.first_token_path_s)


def layerwise_end(prefill_s: float, layers: int, send_s: float, link_from_s: float = 0.0) -> float:
    """When the last of `layers` sends of `send_s` each lands, from the prefill's end: layer k is
    ready at -W + (k + 1) W / L, the link serves one at a time from link_from_s. The last send ends
    at the latest of link_from + L s and every r_k + (L - k) s; r_k rises by W / L a layer, so the
    latest of those is at k = L - 1 (s) or k = 0 (-W + W / L + L s)."""
    first = -prefill_s + prefill_s / layers + layers * send_s
    return max(link_from_s + layers * send_s, send_s, first)


def network_of(link: str, gbps: Optional[float], latency_s: Optional[float]) -> Optional[tuple[float, float]]:
    """(GB/s, latency s) every hand-off crosses under kv_transfer.link; None: the device link."""
    if link not in NETWORKS:
        return None
    default_gbps, default_latency = NETWORKS[link]
    return (default_gbps if gbps is None else gbps, default_latency if latency_s is None else latency_s)
