"""Interoperation with other serving engines' benchmarks (vLLM `bench serve`, SGLang `bench_serving`).

- Export: what a point ran as a Mooncake trace (SGLang replays it) and a vLLM custom dataset,
  and the point's figures in vLLM's result keys (`bench_result`).
- Import: a vLLM or SGLang result file as a results directory (requests.parquet, summary.json,
  ...), so every analysis function reads it (`import_run`).
- Merge: an imported run drawn beside a study's own configurations
  (testbed.studies.merge.add_point).

Command line: `python -m testbed.interop {export,import,add} ...` (see __main__.py).
Nothing here imports torch or an HTTP client.
"""

from testbed.interop.exchange import detect_format, export_point, export_run, import_run, offered_rows
from testbed.interop.mooncake import block_hash_ids, trace_arrivals, write_mooncake_jsonl
from testbed.interop.sglang import read_sglang_result
from testbed.interop.table import InteropError
from testbed.interop.vllm import bench_result, read_vllm_result, write_vllm_custom_jsonl

__all__ = [
    "InteropError",
    "bench_result",
    "block_hash_ids",
    "detect_format",
    "export_point",
    "import_run",
    "offered_rows",
    "export_run",
    "read_sglang_result",
    "read_vllm_result",
    "trace_arrivals",
    "write_mooncake_jsonl",
    "write_vllm_custom_jsonl",
]
