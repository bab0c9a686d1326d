"""testbed: a single-node research testbed for prefill/decode disaggregation in LLM serving."""

from testbed.llm import LLM

__all__ = ["LLM"]
__version__ = "0.1.0"
