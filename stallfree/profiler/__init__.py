"""`stallfree profile`: measure this machine's engine costs in the layout the cost model reads.

Writes, under `--out` (default ./profiles), for device `cpu` (or --device-name):

    <device>/compute/<org>/<model>/mlp.csv   the engine's own layer modules, by token count,
                                             plus an `lm_head` op (logits of sampled rows)
    <device>/compute/attention_n<H>_q<Q>_kv<K>_tp1.csv
                                             the engine's paged_attention, prefill chunks by
                                             cached tokens, decode batches by context
    <device>/cpu_overheads.csv               per-iteration time of real `LLMEngine.step()`
                                             decode batches minus the summed op times above
                                             (signed: may be negative)
    <device>/host.json                       wall seconds per CPU second of those steps

Times are CPU seconds of this process, not wall seconds: an op's microbenchmark
(microseconds) is never preempted while a whole iteration (tenths of a second) shares
the core with whatever else runs, so wall-clock medians would mix a quiet machine
(ops) with a busy one (steps). The busy machine is one factor, `wall_per_cpu` in
host.json, that the cost model applies to every iteration (1.0 on a quiet core; override
with `stallfree simulate --cpu-slowdown`).

Then `stallfree simulate --gpu cpu --profile-dir <out> --model smollm2-135m ...` predicts
this machine. The default grid runs in about two minutes on two cores; --quick is a smoke run.

Modules: `run.py` (the whole profile, `run_profile`), `ops.py` (a layer's token-level
ops), `attention.py` (paged attention), `steps.py` (whole engine steps), `timing.py`.
This package runs tensors; the simulator (`stallfree.sim`) only reads what it writes.
"""
from .run import FULL, QUICK, ProfileConfig, run_profile

__all__ = ["FULL", "QUICK", "ProfileConfig", "run_profile"]
