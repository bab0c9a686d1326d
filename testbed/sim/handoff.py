"""The simulator's KV hand-off times: the link a P -> D pair crosses and the connector's rule
(testbed/control/handoff.py) on the virtual clock.

The link: the slower device link of the two ends (sim/devices.py transfer_time), or the network
between two nodes of hardware.num_nodes, or under kv_transfer.link=rdma|tcp that network for every
hand-off. send and pull hold P's link after the prefill (and the host's hand-off wait);
push_layerwise holds it from the prefill's first layer on, the layers leaving from inside the
forward pass, so no hand-off wait goes before them. A prefill of several chunks overlaps its
layers with its last step only (earlier chunks' KV goes with the last step's layers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from testbed.control.handoff import HandoffRule, Link
from testbed.errors import ConfigError
from testbed.serving import Serving
from testbed.sim.devices import RoleProfile, transfer_time


@dataclass(frozen=True)
class LinkSlot:
    """One send on P's link, in the simulator's seconds: it holds the link from `start` to `end`;
    D may decode from `ready`."""

    start: float
    end: float
    ready: float


class SimHandoff:
    def __init__(self, cfg: Serving, roles: list[RoleProfile], nodes: list[int], layers: int):
        kv = cfg.kv_transfer
        self.rule: HandoffRule = kv.handoff_rule(layers, cfg.engine.block_size)
        self.roles, self.nodes, self.backend = roles, nodes, kv.backend
        self.internode = (cfg.hardware.internode_gbps, cfg.hardware.internode_latency_s)
        self.network = kv.network  # rdma | tcp: every hand-off crosses it
        if kv.link == Link.NVLINK and len(set(nodes)) > 1 and cfg.mode == "disagg":
            raise ConfigError(
                f"kv_transfer.link=nvlink: P and D sit on different nodes (hardware.num_nodes="
                f"{cfg.hardware.num_nodes}) and NVLink does not leave a node; use auto, rdma or tcp"
            )

    @property
    def waits_for_host(self) -> bool:
        """send and pull start after the router's hand-off; push_layerwise from the forward pass."""
        return not self.rule.layerwise

    def link_s(self, prefill: int, decode: int, nbytes: float) -> float:
        """`nbytes` from `prefill` to `decode` over the link between them."""
        crosses = self.nodes[prefill] != self.nodes[decode]  # P's and D's nodes: the network between them
        network = self.network or (self.internode if crosses else None)
        return transfer_time(self.roles[prefill], self.roles[decode], nbytes, self.backend, network)

    def slot(
        self,
        prefill: int,
        decode: int,
        nbytes: int,
        tokens: int,
        now: float,
        link_free_at: float,
        scale: float = 1.0,
        handoff_t: Optional[float] = None,
        prefill_s: float = 0.0,
        ready_t: Optional[float] = None,
    ) -> LinkSlot:
        """The send of a request prefilled by `handoff_t` (its last step `prefill_s` long), asked
        for at `now` with P's link free from `link_free_at` and D ready from `ready_t` (a push
        needs its D before its layers can go); `scale`: both ends' contention."""

        def link(b: float) -> float:
            return self.link_s(prefill, decode, b) * scale

        if not self.rule.layerwise:
            start = max(now, link_free_at)
            end = start + self.rule.busy_s(link, nbytes, tokens)
            return LinkSlot(start, end, end + self.rule.first_token_path_s)
        done = now if handoff_t is None else handoff_t
        since = max(link_free_at, now if ready_t is None else ready_t)
        leg = self.rule.leg(link, nbytes, tokens, prefill_s, since - done)
        end = max(done + leg.end, now)  # never before the event that asked for it
        return LinkSlot(min(done + leg.start, end), end, end + self.rule.first_token_path_s)
