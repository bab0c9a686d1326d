"""`executor=vllm`: real vLLM deployments the testbed launches (colocated, chunked, P/D over a KV
connector), drives with its own workload and router over HTTP, measures from both sides, and ends."""
