"""Placements of N devices over tensor-parallel workers: what the `plan` study searches with
`experiment.own.tp_degrees`, and how every study lays out a given TP degree (catalog.layouts).

A placement is a serving configuration with each worker's TP degree: disagg with p prefill workers
of TP a and d decode workers of TP b (p x a + d x b = N), colocated or chunked with N / c workers of
TP c. Labels keep the one-device names where every degree is 1 (`1P7D`, `colocated`), so a TP1
placement still pairs with a measured ratio_sweep, and say the degrees otherwise (`2xTP2P-1xTP4D`,
`colocated-TP2`). A placement is pruned, before anything runs, when one of its degrees does not
split the model's heads, or when a device of one of its groups cannot hold its share of the
weights and of one max_model_len sequence's KV within engine.gpu_memory_utilization (the
simulator's own pool rule, so a kept placement always starts): testbed/sim/fit.py, the rule the
planners check too.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

from testbed.config import Config, with_overrides
from testbed.errors import ConfigError
from testbed.names import Kind, Mode
from testbed.perf.resolve import is_gpu, table_gpu
from testbed.sim.devices import gpu_dtype_bytes
from testbed.sim.fit import split_counts, split_label, unfit


class Placement(NamedTuple):
    mode: str
    workers: int  # mixed workers, or prefill workers (disagg)
    tp: int  # their TP degree
    decode: int = 0  # decode workers (disagg)
    decode_tp: int = 1  # their TP degree

    @property
    def label(self) -> str:
        if self.mode != Mode.DISAGG:
            return self.mode if self.tp == 1 else f"{self.mode}-TP{self.tp}"
        return split_label(self.workers, self.tp, self.decode, self.decode_tp)

    @property
    def overrides(self) -> dict:
        if self.mode != Mode.DISAGG:
            return {"mode": self.mode, "cluster.num_workers": self.workers, "cluster.tp": self.tp}
        return {
            "mode": self.mode,
            "cluster.num_prefill": self.workers,
            "cluster.num_decode": self.decode,
            "cluster.prefill_tp": self.tp,
            "cluster.decode_tp": self.decode_tp,
        }

    def overrides_over(self, cluster) -> dict:
        """`overrides` less the TP degrees `cluster` (the study's base) has already: a TP1 layout's
        points are set as before TP existed."""
        same = {
            k
            for k, v in self.overrides.items()
            if k.endswith("tp") and getattr(cluster, k.removeprefix("cluster.")) == v
        }
        return {k: v for k, v in self.overrides.items() if k not in same}

    @property
    def knobs(self) -> dict:
        """The degrees as sweep-table columns (figures by degree)."""
        if self.mode != Mode.DISAGG:
            return {"tp": self.tp}
        return {"prefill_tp": self.tp, "decode_tp": self.decode_tp}

    def degrees(self) -> list[tuple[str, int]]:
        """(worker kind, TP degree) of each kind of worker it runs."""
        if self.mode != Mode.DISAGG:
            return [(Kind.MIXED, self.tp)]
        return [(Kind.PREFILL, self.tp), (Kind.DECODE, self.decode_tp)]


def mixed(mode: str, n: int, degrees: list[int]) -> list[Placement]:
    """N / c workers of TP c, for each degree c that divides N."""
    return [Placement(mode, n // c, c) for c in sorted(set(degrees)) if n % c == 0]


def disaggregated(n: int, degrees: list[int]) -> list[Placement]:
    """Every p prefill workers of TP a and d decode workers of TP b with p x a + d x b = N, p, d >= 1."""
    out = []
    for a in sorted(set(degrees)):
        for b in sorted(set(degrees)):
            out += [Placement(Mode.DISAGG.value, p, a, d, b) for p, d in split_counts(n, a, b)]
    return out


def splits(n: int, a: int, b: int) -> list[Placement]:
    """The disaggregated placements of N devices with prefill TP a and decode TP b."""
    return [s for s in disaggregated(n, [a, b]) if (s.tp, s.decode_tp) == (a, b)]


def middle_split(n: int, a: int, b: int) -> Optional[Placement]:
    """The split whose prefill workers take the devices nearest half of N (N // 2 P at TP1)."""
    return min(splits(n, a, b), key=lambda s: abs(2 * s.workers * a - n), default=None)


def pruned(cfg: Config, placement: Placement) -> Optional[str]:
    """Why a placement cannot run (heads that do not split, a device that does not hold its share),
    or None."""
    args, simulated = cfg.model.args(), cfg.executor == "sim"
    for kind, tp in placement.degrees():
        spec = cfg.sim.spec(kind) if simulated else real_device(cfg, kind)
        if args.splits_over(tp) and tp > 1 and simulated and (spec is None or not is_gpu(spec)):
            raise ConfigError(
                f"experiment.own.tp_degrees: tensor parallelism is modelled on the analytical GPUs only; "
                f"{cfg.sim.key(kind)}={spec or 'the shipped CPU profile'} is not one (sim.profile=h100_sxm, ...)"
            )
        # a simulated device holds its weights and KV as sim.weight_bits / weight_dtype / kv_dtype say;
        # a real one its checkpoint's
        widths = cfg.sim.precision() if simulated else {}
        why = unfit(args, tp, spec, gpu_dtype_bytes(cfg.model.dtype), cfg.engine.gpu_memory_utilization, **widths)
        if why:
            return why
    return None


def real_device(cfg: Config, kind: str) -> Optional[str]:
    """The analytical GPU a real run's placement is judged on: the emulated device of the worker's
    kind (hardware.emulate), else the visible GPU's entry of the table; None where neither says
    (CPU workers, or a GPU the table lacks: every placement is tried as asked)."""
    from testbed.cluster.emulation import Emulation
    from testbed.cluster.layout import cuda_count

    emulation = Emulation.from_hardware(cfg.hardware)
    if emulation is not None:
        return getattr(emulation, kind) or emulation.mixed
    if not cuda_count(cfg.hardware):
        return None
    import torch

    return table_gpu(torch.cuda.get_device_name(0))


def holds(cfg: Config, tp: int) -> Optional[str]:
    """Why workers of TP `tp` in every role (mixed, prefill, decode) cannot run, or None."""
    return pruned(cfg, Placement(Mode.COLOCATED.value, 1, tp)) or pruned(
        cfg, Placement(Mode.DISAGG.value, 1, tp, 1, tp)
    )


def fitting_degrees(cfg: Config, n: int) -> tuple[list[int], Optional[str]]:
    """ratio_sweep's degrees where experiment.own.tp_degrees is left at [1]: [1] (and None) where one
    device holds the model, as always; otherwise the smallest degree c dividing N whose workers
    hold their share, and 2c where that divides N too, with one line saying why: a simulated run on
    an analytical GPU, or a real one on a GPU of the table or an emulated one (real_device)."""
    why = holds(cfg, 1) if cfg.executor in ("sim", "real") else None
    if why is None:
        return [1], None
    for c in (2**k for k in range(1, n.bit_length())):
        if n % c == 0 and holds(cfg, c) is None:
            degrees = [c, 2 * c] if n % (2 * c) == 0 else [c]
            return degrees, (
                f"experiment.own.tp_degrees={degrees}: one device cannot hold {cfg.model.name} ({why}); "
                f"TP{c} is the smallest degree whose workers hold it on {n} devices"
                + (f", TP{2 * c} the one above it" if len(degrees) > 1 else "")
            )
    raise ConfigError(
        f"{cfg.model.name} fits no tensor-parallel degree of {n} devices ({why}); simulate more devices or a larger GPU"
    )


def planning(cfg: Config, n: int) -> tuple[Config, Optional[str]]:
    """The configuration the P:D planners (testbed/sim/load_split.py, slo_split.py) plan N simulated
    devices with: the cluster's own degrees, or where those are one device each and one device
    cannot hold the model, prefill and decode workers of the smallest degree whose workers hold it
    (fitting_degrees, judged on the simulated devices), with one line saying why."""
    c = cfg.cluster
    if (c.prefill_tp, c.decode_tp) != (1, 1):
        return cfg, None
    simulated = cfg if cfg.executor == "sim" else with_overrides(cfg, {"executor": "sim"})
    degrees, why = fitting_degrees(simulated, n)
    if why is None:
        return cfg, None
    tp = degrees[0]
    return with_overrides(cfg, {"cluster.prefill_tp": tp, "cluster.decode_tp": tp}), (
        f"workers of TP{tp}: one device cannot hold {cfg.model.name} ({holds(simulated, 1)})"
    )


def search(cfg: Config, n: int, degrees: Sequence[int]) -> tuple[list[Placement], dict[str, str]]:
    """The placements of N devices over the tensor-parallel `degrees` (plan, ratio_sweep), in their
    order (colocated, disagg, chunked), and those pruned with why; none left is refused in one line."""
    degrees = list(degrees)
    found = mixed(Mode.COLOCATED.value, n, degrees) + disaggregated(n, degrees) + mixed(Mode.CHUNKED.value, n, degrees)
    why = {p.label: pruned(cfg, p) for p in found}
    kept = [p for p in found if why[p.label] is None]
    if not kept:
        first = next(iter(why.values()), "no placement divides them")
        raise ConfigError(
            f"experiment.own.tp_degrees={degrees}: no placement of {n} devices can run ({first}); "
            f"add higher degrees or simulate a larger GPU"
        )
    return kept, {label: reason for label, reason in why.items() if reason}
