"""testbed: a single-node research testbed for prefill/decode disaggregation in LLM serving."""

__all__ = ["LLM"]
__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in torch (seconds); a simulated run, which never needs it, does not pay that
    if name == "LLM":
        from testbed.llm import LLM

        return LLM
    raise AttributeError(f"module 'testbed' has no attribute {name!r}")
