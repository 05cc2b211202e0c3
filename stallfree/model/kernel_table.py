"""The kernel table: which implementation runs each op, chosen once, at load, and why.

`choose_kernels` reads this machine's facts (`KernelFacts`: the kernel library, the CPU's
AMX and AVX512_BF16, oneDNN's bf16), the dtype, the device, tensor parallelism and the
head size, and takes each op's first implementation that can run (stallfree/kernel_ops.py
lists them, fastest first, the reference last). The engine's `kernels` setting overrides a
choice, per engine: asking for one that cannot run here is an error that says why. The
model and the sampler read their choices from the table handed to them at load; what
still varies per call (a batch's row count, a cache's block size) the call checks itself.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, fields, replace

import torch

from ..kernel_ops import KERNEL_OPS, check_kernels, reference
from . import kernels, paged_decode

PAIR_KERNEL = ("amx", "avx512_bf16")  # matmul_bf16's impls that run the tile packing


@dataclass(frozen=True)
class Choice:
    impl: str
    reason: str
    kernel: bool = field(init=False)  # not the reference: read on every call, so a field

    def __post_init__(self) -> None:
        object.__setattr__(self, "kernel", self.impl not in ("torch", "python"))


@dataclass(frozen=True)
class KernelFacts:
    """What this process's CPU and kernel build allow; each `None`, or why not."""

    vector_flags: str
    library: str | None  # the kernel library is loaded
    amx: str | None  # AMX tiles run (the CPU has them and the OS lets this process use them)
    bf16_vectors: str | None  # the kernels' AVX512_BF16 paths run
    onednn_bf16: str | None  # oneDNN takes bf16 weights
    march: str = kernels.MARCH

    @staticmethod
    @functools.cache
    def here() -> KernelFacts:
        """This process's facts, found once (they hold for the process)."""
        return KernelFacts(kernels.vector_flags(), kernels.unavailable_reason(),
                           kernels.amx_unavailable_reason(),
                           kernels.bf16_vectors_unavailable_reason(),
                           kernels.onednn_bf16_unavailable_reason())

    def lines(self) -> list[tuple[str, str]]:
        """(fact, value) pairs for `stallfree info`."""
        library = (f"loaded from {kernels.library_path()} (-march={self.march})"
                   if self.library is None else f"not in use: {self.library}")
        return [("vector flags", self.vector_flags or "(none found)"),
                ("kernel library", library), ("AMX tiles", self.amx or "yes"),
                ("AVX512_BF16 vectors", self.bf16_vectors or "yes"),
                ("oneDNN bf16", self.onednn_bf16 or "yes")]


@dataclass(frozen=True)
class KernelTable:
    """One Choice per op of kernel_ops.KERNEL_OPS (the fields, in that order)."""

    matmul_bf16: Choice
    matmul_bf16_few_rows: Choice
    matmul_f32: Choice
    matmul_quant: Choice
    decode_attention: Choice
    prefill_attention: Choice
    norm: Choice
    rope_cache: Choice
    argmax: Choice
    layer_loop: Choice
    facts: KernelFacts | None = field(default=None, compare=False)

    def items(self) -> Iterator[tuple[str, Choice]]:
        return ((op, getattr(self, op)) for op in KERNEL_OPS)

    def with_choice(self, op: str, choice: Choice) -> KernelTable:
        return replace(self, **{op: choice})

    def rows(self) -> tuple[tuple[str, str, str], ...]:
        """(op, impl, reason) per op: the table as the start-up log and metrics carry it."""
        return tuple((op, c.impl, c.reason) for op, c in self.items())

    def summary(self) -> str:
        """"op=impl,..." on one line."""
        return ",".join(f"{op}={c.impl}" for op, c in self.items())


# A candidate: (impl, why it cannot run here or None, what it is). The first that can run
# is the default.
Candidate = tuple[str, str | None, str]


def _first(*reasons: str | None) -> str | None:
    return next((r for r in reasons if r is not None), None)


def _dtype_reason(dtype: torch.dtype | None, allowed: tuple[torch.dtype, ...]) -> str | None:
    if dtype is None or dtype in allowed:
        return None
    return f"no kernel for {str(dtype).removeprefix('torch.')}"


@dataclass(frozen=True)
class _Inputs:
    facts: KernelFacts
    dtype: torch.dtype | None  # None: any (each call checks its tensors' dtype)
    tp_size: int
    head_dim: int | None  # None: any (each call checks its shapes)
    quantized: bool  # some matmul weights are kept quantized


def _matmul_bf16(i: _Inputs, _: dict[str, Choice]) -> list[Candidate]:
    f = i.facts
    vectors = _first(f.bf16_vectors, None if f.amx else "this CPU runs the tile packing "
                                                      "in AMX tiles")
    return [("amx", f.amx, "weights in the tile packing, matmuls of up to 1024 rows in AMX "
                           "tiles (torch's beyond)"),
            ("avx512_bf16", vectors, "weights in the tile packing, matmuls in AVX512_BF16 "
                                     "vectors"),
            ("onednn", f.onednn_bf16, "oneDNN, from weights prepacked at load"),
            ("torch", None, "F.linear")]


def _few_rows(i: _Inputs, _: dict[str, Choice]) -> list[Candidate]:
    return [("skinny", i.facts.library, "the few-row kernel (bf16 widened to fp32 vectors), "
                                        "for weights not in the tile packing"),
            ("torch", None, "F.linear")]


def _matmul_f32(i: _Inputs, _: dict[str, Choice]) -> list[Candidate]:
    return [("f32", i.facts.library, "weights packed at load, every row count in the kernel"),
            ("torch", None, "F.linear")]


def _matmul_quant(i: _Inputs, _: dict[str, Choice]) -> list[Candidate]:
    return [("kernel", i.facts.library, "weights kept quantized, x quantized to int8 per block "
                                        "of 32, integer dot products"),
            ("torch", None, "the weight dequantized on every call, then F.linear")]


def _attention(i: _Inputs, prefill: bool) -> list[Candidate]:
    f, dtype, head_dim = i.facts, i.dtype, i.head_dim
    if prefill:
        shape = (None if head_dim is None or head_dim % 32 == 0
                 else f"head_dim {head_dim} is no multiple of 32")
        bf16 = f.bf16_vectors if dtype == torch.bfloat16 else None
        can = _first(f.library, _dtype_reason(dtype, (torch.bfloat16, torch.float32)), shape,
                     bf16)
        what = "every chunk in one call, its context read in place"
    else:
        shape = (None if head_dim is None or head_dim in paged_decode.HEAD_DIMS
                 else f"head_dim {head_dim} is not one of {paged_decode.HEAD_DIMS}")
        can = _first(f.library, _dtype_reason(dtype, paged_decode.DTYPES), shape)
        what = "the cache read in place"
    not_bf16 = None if dtype in (None, torch.bfloat16) else "AMX scores need a bfloat16 cache"
    return [("amx", _first(can, f.amx, not_bf16), f"the paged kernel, {what}, scores in AMX "
                                                   "tiles"),
            ("vectors", can, f"the paged kernel, {what}"),
            ("torch", None, "KV blocks gathered, SDPA")]


def _fused(i: _Inputs, what: str, shape: str | None = None) -> list[Candidate]:
    can = _first(i.facts.library, _dtype_reason(i.dtype, (torch.float32, torch.bfloat16)), shape)
    return [("kernel", can, what), ("torch", None, "torch ops")]


def _rope_cache(i: _Inputs, _: dict[str, Choice]) -> list[Candidate]:
    shape = (None if i.head_dim is None or i.head_dim % 32 == 0
             else f"head_dim {i.head_dim} is no multiple of 32")
    return _fused(i, "RoPE on q and k and the cache write in one pass", shape)


def _layer_loop(i: _Inputs, chosen: dict[str, Choice]) -> list[Candidate]:
    f32 = chosen["matmul_f32"].kernel and i.dtype in (None, torch.float32)
    bf16 = chosen["matmul_bf16"].impl in PAIR_KERNEL and i.dtype in (None, torch.bfloat16)
    # Quantized weights run in their kernel in any dtype (it converts x and its output).
    quant = i.quantized and chosen["matmul_quant"].kernel
    can = _first(i.facts.library,
                 "tensor parallelism (an all-reduce between a layer's kernels)"
                 if i.tp_size > 1 else None,
                 None if chosen["norm"].kernel else "norm runs in torch",
                 None if chosen["rope_cache"].kernel else "rope_cache runs in torch",
                 None if f32 or bf16 or quant else "the matmuls do not run in a packed kernel")
    return [("cpp", can, "the decoder layers in one C++ call, for batches whose attention "
                         "runs in the kernels"),
            ("python", None, "the layers loop in Python")]


_RULES: dict[str, Callable[[_Inputs, dict[str, Choice]], list[Candidate]]] = {
    "matmul_bf16": _matmul_bf16, "matmul_bf16_few_rows": _few_rows, "matmul_f32": _matmul_f32,
    "matmul_quant": _matmul_quant,
    "decode_attention": lambda i, _: _attention(i, prefill=False),
    "prefill_attention": lambda i, _: _attention(i, prefill=True),
    "norm": lambda i, _: _fused(i, "residual add + RMSNorm in one pass"),
    "rope_cache": _rope_cache,
    "argmax": lambda i, _: [("kernel", i.facts.library, "one pass over each row"),
                            ("torch", None, "torch.argmax")],
    "layer_loop": _layer_loop,  # last: it needs the other choices
}


def _pick(op: str, candidates: list[Candidate], asked: str | None) -> Choice:
    if asked is not None:
        why = next(why for impl, why, _ in candidates if impl == asked)
        if why is not None:
            raise ValueError(f"kernels: {op}={asked} cannot run here: {why}")
        what = next(w for impl, _, w in candidates if impl == asked)
        return Choice(asked, f"{what} (asked for)")
    skipped = []
    for impl, why, what in candidates:
        if why is None:
            return Choice(impl, what + "".join(f"; not {s}" for s in skipped))
        skipped.append(f"{impl}: {why}")
    raise AssertionError(f"{op}: its reference cannot run")  # the last never has a reason


def choose_kernels(overrides: Mapping[str, str] | str | None = None, *,
                   dtype: torch.dtype | None = None, device_type: str = "cpu",
                   tp_size: int = 1, head_dim: int | None = None,
                   facts: KernelFacts | None = None, quantized: bool = False) -> KernelTable:
    """Each op's implementation for a model in `dtype` on `device_type` (None: any dtype,
    each call checks its own) whose matmul weights are `quantized` or not, `overrides` (op ->
    impl) taken where they can run."""
    asked = check_kernels(overrides)
    facts = facts or KernelFacts.here()
    if device_type != "cpu":
        for op, impl in asked.items():
            if impl != reference(op):
                raise ValueError(f"kernels: {op}={impl} cannot run here: not a CPU")
        where = f"on {device_type}: torch's own kernels"
        return KernelTable(**{op: Choice(reference(op), where) for op in KERNEL_OPS},
                           facts=facts)
    inputs = _Inputs(facts, dtype, tp_size, head_dim, quantized)
    chosen: dict[str, Choice] = {}
    for op, rule in _RULES.items():
        chosen[op] = _pick(op, rule(inputs, chosen), asked.get(op))
    return KernelTable(**chosen, facts=facts)


@functools.cache
def default_kernels() -> KernelTable:
    """The table of a CPU model of any dtype without overrides: for the calls made outside
    a model (tests, benchmarks) that hand no table of their own."""
    return choose_kernels()


def reference_kernels() -> KernelTable:
    """Every op on its reference path (torch, the Python loop)."""
    return choose_kernels({op: reference(op) for op in KERNEL_OPS})


def ensure(table: KernelTable | None) -> KernelTable:
    return default_kernels() if table is None else table


assert tuple(f.name for f in fields(KernelTable))[:-1] == tuple(KERNEL_OPS) == tuple(_RULES)
