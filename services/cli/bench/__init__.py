"""``kvmesh bench``: a load generator for any OpenAI-compatible completions endpoint.

Its metrics (TTFT, TPOT, ITL, E2EL, throughputs) are defined exactly as
``vllm bench serve`` defines them, so a kvmesh run and a vLLM run of the same
workload can be compared number for number.
"""
