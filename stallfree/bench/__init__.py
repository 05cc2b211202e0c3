"""Benchmark tooling: workloads, a streaming client, the report, capacity search, plots.

Nothing here imports torch (convert.py does, when run): the client measures any
OpenAI-compatible server (stallfree, vLLM, llama.cpp's server) the same way.
`records.py`, `config.py`, `report.py` and `capacity*.py` import no HTTP code either,
so the simulator reuses them. The commands are in `stallfree/cli/bench.py`.
"""
