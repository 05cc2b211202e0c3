"""Benchmark tooling: workloads, a streaming client, the report, capacity search, plots.

Nothing here imports torch (convert.py does, when run): the client measures any OpenAI-compatible server
(stallfree, vLLM, llama.cpp's server) the same way. See `cli.py` for the
commands and `capacity.py` for the search a simulator can reuse.
"""
