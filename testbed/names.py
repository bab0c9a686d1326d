"""The names that cross packages, once: modes, worker roles and kinds, executors, the KV hand-off's
choices. StrEnum members equal (and hash as) their plain strings, so configs and results files keep
the strings. Reading a member off its class costs ~0.15 us on Python 3.11: hot loops compare
against a member held in a local or an attribute."""

from __future__ import annotations

from enum import Enum

try:
    from enum import StrEnum
except ImportError:  # Python 3.10: the same, as far as these names use it

    class StrEnum(str, Enum):
        def __str__(self) -> str:
            return str.__str__(self)


class Mode(StrEnum):
    COLOCATED = "colocated"
    CHUNKED = "chunked"
    DISAGG = "disagg"


class Role(StrEnum):
    """A worker's scheduler policy (testbed/engine/policies.py)."""

    COLOCATED = "colocated"
    CHUNKED = "chunked"
    PREFILL_ONLY = "prefill_only"  # P: prefills, then hands the KV off
    DECODE_ONLY = "decode_only"  # D: decodes the KV it received


class Kind(StrEnum):
    """The kind of worker a role makes: a simulated or emulated device per kind, and where a
    prompt was prefilled (requests.parquet `prefilled_on`)."""

    MIXED = "mixed"
    PREFILL = "prefill"
    DECODE = "decode"


KIND_OF = {
    Role.COLOCATED: Kind.MIXED,
    Role.CHUNKED: Kind.MIXED,
    Role.PREFILL_ONLY: Kind.PREFILL,
    Role.DECODE_ONLY: Kind.DECODE,
}


class Executor(StrEnum):
    REAL = "real"  # worker processes on the real clock
    SIM = "sim"  # the simulator
    HTTP = "http"  # a client of an OpenAI-compatible server
    VLLM = "vllm"  # vLLM deployments the testbed launches and drives (testbed/deploy/)


# -- the KV hand-off (kv_transfer.*) --------------------------------------------------------------
class Granularity(StrEnum):
    REQUEST = "request"  # one message after the prefill
    LAYER = "layer"  # one per layer, streamed during the prefill


class Binding(StrEnum):
    """When the decode worker is bound (kv_transfer.decode_binding)."""

    EARLY = "early"  # at arrival: D reserves while P queues the prefill
    LATE = "late"  # when the prefill ends


class Multiturn(StrEnum):
    """A session's later turns (kv_transfer.multiturn)."""

    RESEND = "resend"  # through P, the whole prompt's KV again
    INCREMENTAL = "incremental"  # through P, which sends only the blocks D's cache lacks
    PPD = "ppd"  # straight to the decode worker whose cache holds most of the prompt


class KVBackend(StrEnum):
    PROCESS_GROUP = "process_group"  # torch.distributed's process group (NCCL between GPUs, gloo on CPU)
    IPC = "ipc"  # P writes into D's blocks through D's mapped pool (one box)


class OnFailure(StrEnum):
    """What D does once a KV transfer attempt failed (kv_transfer.on_failure, retry_fallback)."""

    FAIL = "fail"
    RECOMPUTE = "recompute"  # D prefills the request itself
    RETRY = "retry"  # P sends again
