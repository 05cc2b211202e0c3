"""The names of the kernel table's ops and of each op's implementations, and the `kernels`
engine setting that overrides the table's choices (`--kernels decode_attention=torch`).

Pure Python, so that the configuration checks a setting before anything loads: which
implementation can run here, and why one is chosen, is stallfree/model/kernel_table.py's.
"""
from __future__ import annotations

from collections.abc import Mapping

# op -> its implementations, the fastest first as the table prefers them, the reference
# (torch's ops, or the Python layer loop) last: the reference runs everywhere.
KERNEL_OPS: dict[str, tuple[str, ...]] = {
    # bfloat16 matmuls: the tile packing's kernel (AMX tiles, or AVX512_BF16 vectors where
    # the CPU has no AMX), oneDNN from weights prepacked at load, or F.linear.
    "matmul_bf16": ("amx", "avx512_bf16", "onednn", "torch"),
    # bfloat16 matmuls of a few rows whose weights are not in the tile packing.
    "matmul_bf16_few_rows": ("skinny", "torch"),
    "matmul_f32": ("f32", "torch"),
    # Matmuls from weights kept quantized (GGUF's 4- and 8-bit types, int8): integer dot
    # products in the kernel, or the weight dequantized on every call for F.linear.
    "matmul_quant": ("kernel", "torch"),
    # Attention over the paged cache, read in place (scores in AMX tiles or vectors), or
    # its blocks gathered for SDPA.
    "decode_attention": ("amx", "vectors", "torch"),
    "prefill_attention": ("amx", "vectors", "torch"),
    "norm": ("kernel", "torch"),  # RMSNorm, and the residual add before it
    "rope_cache": ("kernel", "torch"),  # RoPE on q and k, and k and v written to the cache
    "argmax": ("kernel", "torch"),  # greedy sampling's argmax over the vocabulary
    "layer_loop": ("cpp", "python"),  # the decoder layers in one C++ call
}


def reference(op: str) -> str:
    """The op's reference implementation: the one that runs everywhere."""
    return KERNEL_OPS[op][-1]


def check_kernels(overrides: Mapping[str, str] | str | None) -> dict[str, str]:
    """`overrides` (op -> implementation, or its "op=impl,..." text) as a dict, each name
    checked; a ValueError names a wrong one and the valid ones."""
    if overrides is None:
        return {}
    if isinstance(overrides, str):
        return parse_kernels(overrides)
    checked = {}
    for op, impl in overrides.items():
        if op not in KERNEL_OPS:
            raise ValueError(f"kernels: no op {op!r} (ops: {', '.join(KERNEL_OPS)})")
        if impl not in KERNEL_OPS[op]:
            raise ValueError(f"kernels: {op} has no implementation {impl!r} "
                             f"(it has {', '.join(KERNEL_OPS[op])})")
        checked[op] = impl
    return checked


def parse_kernels(text: str) -> dict[str, str]:
    """'decode_attention=torch,layer_loop=python' -> {op: impl}, checked."""
    pairs = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        op, sep, impl = item.partition("=")
        if not sep:
            raise ValueError(f"kernels: expected op=impl, got {item!r}")
        pairs[op.strip()] = impl.strip()
    return check_kernels(pairs)


def format_kernels(overrides: Mapping[str, str]) -> str:
    """The inverse of parse_kernels."""
    return ",".join(f"{op}={impl}" for op, impl in overrides.items())
