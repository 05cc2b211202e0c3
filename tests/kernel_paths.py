"""One loaded engine on another kernel path for a block: its model's table chosen again with
the `kernels` setting's overrides (the weights repacked for it), then the engine's own."""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from stallfree.kernel_ops import KERNEL_OPS, reference

# Every op on its reference path: torch's ops, the Python layer loop.
REFERENCE = {op: reference(op) for op in KERNEL_OPS}


@contextmanager
def engine_kernels(llm, overrides: Mapping[str, str]) -> Iterator[None]:
    executor = llm.engine.executor
    previous = executor.model.kernel_overrides
    executor.use_kernels(overrides)
    try:
        yield
    finally:
        executor.use_kernels(previous)
