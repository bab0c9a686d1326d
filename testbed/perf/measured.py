"""The measured cost model: coefficients fitted to a profile of this engine on a device.

    step_time = overhead + a * prefill_tokens + b * prefill_tokens * prefill_context
                         + c * decode_seqs + d * decode_context
    transfer_time = latency + nbytes / bandwidth

`prefill_context` is the mean number of keys the attention kernel computes per prefill token,
so `prefill_tokens * prefill_context` is the step's attention work however many chunks it
holds (`CostModel.prefill_context` computes it from the chunks). A causal kernel (flash-attn)
skips the masked half of a chunk: token i of a chunk after k cached tokens costs k + i keys.
The torch SDPA backend computes the whole masked (k + n) x n matrix: k + n keys per token.
`decode_context` is the total context (KV tokens read) of the step's decodes.

Coefficients are non-negative (a negative cost would let a bigger batch run faster) and are
fitted by non-negative least squares on relative error: step times span milliseconds to
seconds and a plain fit would ignore the short steps, which are most of a decode-heavy run.

A profile is JSON written by `+experiment=profile` (testbed.measure.step_profile). This module is pure
(numpy only) so the simulator and the real cluster's paced workers share it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Mapping, Optional, Sequence

import numpy as np

from testbed.errors import ConfigError
from testbed.model.config import ModelArgs
from testbed.perf.attention import attended_context

STEP_TERMS = (
    "overhead_s",
    "per_prefill_token_s",
    "per_attended_pair_s",
    "per_decode_seq_s",
    "per_decode_context_token_s",
)
STEP_INPUTS = ("prefill_tokens", "prefill_context", "decode_seqs", "decode_context")
# the shape fields a profile must share with the configured model (max_model_len only bounds lengths)
SHAPE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads")


def step_features(
    prefill_tokens: float, prefill_context: float, decode_seqs: float, decode_context: float
) -> list[float]:
    return [1.0, prefill_tokens, prefill_tokens * prefill_context, decode_seqs, decode_context]


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """min ||a x - b|| subject to x >= 0 (Lawson-Hanson active set; numpy has no NNLS and scipy is
    not a dependency). Columns are scaled to unit norm first so the tolerance means the same for
    a constant and for a term in the millions."""
    norms = np.linalg.norm(a, axis=0)
    norms[norms == 0] = 1.0
    a = a / norms
    n = a.shape[1]
    x, active = np.zeros(n), np.zeros(n, dtype=bool)
    tol = 1e-10 * max(1.0, float(np.abs(a.T @ b).max()))
    for _ in range(3 * n):
        gradient = a.T @ (b - a @ x)
        if active.all() or gradient[~active].max() <= tol:
            break
        active[np.argmax(np.where(active, -np.inf, gradient))] = True
        while True:
            z = np.zeros(n)
            z[active] = np.linalg.lstsq(a[:, active], b, rcond=None)[0]
            if (z[active] > 0).all():
                x = z
                break
            shrinking = active & (z <= 0)
            step = np.min(x[shrinking] / (x[shrinking] - z[shrinking]))
            x = x + step * (z - x)
            active &= x > tol
            x[~active] = 0.0
    return x / norms


def relative_fit(features: np.ndarray, seconds: np.ndarray) -> tuple[np.ndarray, dict]:
    """Non-negative coefficients minimising the squared relative error; and that error."""
    weights = 1.0 / seconds
    coef = nnls(features * weights[:, None], np.ones_like(seconds))
    rel = np.abs(features @ coef - seconds) / seconds
    return coef, {"mean": float(rel.mean()), "max": float(rel.max()), "samples": int(len(seconds))}


# kv_transfer.backend -> its (latency, bytes per second) coefficients
TRANSFER_TERMS = {
    "process_group": ("transfer_latency_s", "transfer_bytes_per_s"),
    "ipc": ("ipc_latency_s", "ipc_bytes_per_s"),
}


def require_transport(model, backend: str, what: str) -> None:
    """A cost model (`what`, for the message) must time KV transfers over kv_transfer.backend: the one
    check the simulator, the P:D split estimates and emulated links all make."""
    if backend in model.transports:
        return
    if backend == "ipc":
        raise ConfigError(
            f"kv_transfer.backend=ipc: {what} has no ipc transfer samples; profile again "
            "(python -m testbed +experiment=profile) or use kv_transfer.backend=process_group"
        )
    raise ConfigError(
        f"kv_transfer.backend={backend}: {what} has transfer times for ipc only (fitted on a run over "
        "ipc); use kv_transfer.backend=ipc, or a profile or run of this transport"
    )


def fit_step(samples: Sequence[Mapping]) -> tuple[dict, dict]:
    """Coefficients (STEP_TERMS) and the relative error on the samples, from rows holding
    STEP_INPUTS and `seconds`."""
    features = np.array([step_features(*(float(s[k]) for k in STEP_INPUTS)) for s in samples])
    coef, error = relative_fit(features, np.array([float(s["seconds"]) for s in samples]))
    return dict(zip(STEP_TERMS, map(float, coef))), error


def link_time(latency_s: float, bytes_per_s: float, nbytes):
    """A KV transfer's time on a fitted link: its latency, then its bytes at its bandwidth (nbytes
    may be an array)."""
    return latency_s + nbytes / bytes_per_s


def fit_transfer(samples: Sequence[Mapping]) -> tuple[dict, dict]:
    """latency_s and bytes_per_s from rows holding `bytes` and `seconds`."""
    features = np.array([[1.0, float(s["bytes"])] for s in samples])
    coef, error = relative_fit(features, np.array([float(s["seconds"]) for s in samples]))
    bandwidth = 1.0 / coef[1] if coef[1] > 0 else float("inf")
    return {"latency_s": float(coef[0]), "bytes_per_s": float(bandwidth)}, error


@dataclass(frozen=True)
class CostModel:
    overhead_s: float
    per_prefill_token_s: float
    per_attended_pair_s: float
    per_decode_seq_s: float
    per_decode_context_token_s: float
    # KV transfer over the process group (kv_transfer.backend=process_group) and over ipc (P copies into D's
    # mapped pool); None where the profile has no samples of that transport (made before ipc
    # existed, or fitted in situ from a run that used the other one)
    transfer_latency_s: Optional[float] = None
    transfer_bytes_per_s: Optional[float] = None
    causal_attention: bool = True  # how prefill_context counts a chunk's own keys (see above)
    ipc_latency_s: Optional[float] = None
    ipc_bytes_per_s: Optional[float] = None
    # a step that prefills: its fixed cost beyond `overhead_s` (fitted in situ, testbed/sim/in_situ.py;
    # 0 in a profile measured by +experiment=profile)
    prefill_overhead_s: float = 0.0

    @classmethod
    def from_profile(cls, profile: Mapping) -> "CostModel":
        """The profile's fitted coefficients (`cost_model`), or a fit of its raw samples."""
        fitted = profile.get("cost_model") or fit_profile(profile)[0]
        numbers = {k: float(fitted[k]) for k in STEP_TERMS}
        links = {k: float(fitted[k]) for terms in TRANSFER_TERMS.values() for k in terms if fitted.get(k) is not None}
        return cls(
            **numbers,
            **links,
            causal_attention=bool(fitted.get("causal_attention", True)),
            prefill_overhead_s=float(fitted.get("prefill_overhead_s") or 0.0),
        )

    @property
    def transports(self) -> tuple[str, ...]:
        """The kv_transfer.backend values this model has times for."""
        return tuple(backend for backend, (_, rate) in TRANSFER_TERMS.items() if getattr(self, rate) is not None)

    def prefill_context(self, chunks: Iterable[tuple[int, int]]) -> float:
        return attended_context(chunks, self.causal_attention)

    def step_time(self, prefill_tokens: int, prefill_context: float, decode_seqs: int, decode_context: int) -> float:
        return (
            self.overhead_s
            + (self.prefill_overhead_s if prefill_tokens else 0.0)
            + self.per_prefill_token_s * prefill_tokens
            + self.per_attended_pair_s * prefill_tokens * prefill_context
            + self.per_decode_seq_s * decode_seqs
            + self.per_decode_context_token_s * decode_context
        )

    def decode_times(self, decode_seqs: int, context: int, steps: int) -> list[float]:
        """step_time(0, 0.0, decode_seqs, context + decode_seqs x i) for i < steps, to the last bit:
        the sum's terms before the context's are the same float at every step (a decode run's)."""
        head = (
            self.overhead_s
            + 0.0
            + self.per_prefill_token_s * 0
            + self.per_attended_pair_s * 0 * 0.0
            + self.per_decode_seq_s * decode_seqs
        )
        per = self.per_decode_context_token_s
        return [head + per * c for c in range(context, context + decode_seqs * steps, decode_seqs)]

    def transfer_time(self, nbytes: int, backend: str = "process_group") -> float:
        require_transport(self, backend, "this profile")
        latency, rate = TRANSFER_TERMS[backend]
        return link_time(getattr(self, latency), getattr(self, rate), nbytes)

    def as_dict(self) -> dict:
        return asdict(self)


def fit_profile(profile: Mapping) -> tuple[dict, dict]:
    """The `cost_model` (coefficients) and `fit` (relative errors) sections from its `samples`."""
    step, step_error = fit_step(profile["samples"]["step"])
    transfer, transfer_error = fit_transfer(profile["samples"]["transfer"])
    coefficients = {
        **step,
        "transfer_latency_s": transfer["latency_s"],
        "transfer_bytes_per_s": transfer["bytes_per_s"],
        "causal_attention": bool(profile.get("causal_attention", True)),
    }
    errors = {"step_relative_error": step_error, "transfer_relative_error": transfer_error}
    if profile["samples"].get("transfer_ipc"):
        ipc, errors["ipc_relative_error"] = fit_transfer(profile["samples"]["transfer_ipc"])
        coefficients.update(ipc_latency_s=ipc["latency_s"], ipc_bytes_per_s=ipc["bytes_per_s"])
    return coefficients, errors


def load_profile(path: Path, key: str = "sim.profile") -> dict:
    """A profile file's JSON; a one-line error naming `key` when it is missing or malformed."""
    if not path.is_file():
        raise ConfigError(
            f"{key}: {path} not found; profile this model with `python -m testbed +experiment=profile` "
            f"and pass {key}=<its profile.json>"
        )
    try:
        profile = json.loads(path.read_bytes().decode("utf-8"))
    except json.JSONDecodeError as error:
        raise ConfigError(f"{key}: {path} is not valid JSON (line {error.lineno})") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{key}: {path} is not UTF-8 text") from None
    except RecursionError:
        raise ConfigError(f"{key}: {path} nests its JSON too deeply to be a profile") from None
    if not isinstance(profile, dict):
        raise ConfigError(f"{key}: {path} holds a JSON {type(profile).__name__}, not a profile's object")
    return profile


def check_profile(args: ModelArgs, profile: Mapping) -> None:
    """The profile must describe this model's shape (max_model_len aside: it only bounds lengths)."""
    measured = profile["model"]
    wrong = [k for k in SHAPE_KEYS if measured[k] != getattr(args, k)]
    if wrong:
        got = ", ".join(f"{k}={getattr(args, k)} (profile {measured[k]})" for k in wrong)
        raise ConfigError(
            f"the profile of model {profile.get('model_name')!r} does not match the configured model: {got}"
        )
