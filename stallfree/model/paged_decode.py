"""The CPU decode-attention kernel (csrc/paged_decode.cpp): where its build lives, loading
it, and whether a call can use it.

`make` builds the kernel into `.build/` at the repository root (`python -m
stallfree.model.kernel_build`; STALLFREE_BUILD_DIR moves it). The library's name carries
a hash of the source, the compile flags, torch's version and this CPU's flags, since it is
compiled for this CPU (-march=native): a library built elsewhere or from an older source
is never loaded. Without it (no compiler, a failed build, a non-CPU device, another head
size) decode attention takes the torch path of attention.py, which stays the reference;
the first time, one log line says why. STALLFREE_PAGED_DECODE=0 turns the kernel off.
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

logger = logging.getLogger("stallfree.model")

SOURCE = Path(__file__).resolve().parent / "csrc" / "paged_decode.cpp"
# -O3 and the host's vector width: the kernel is plain loops and GCC vector types.
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-g0")
HEAD_DIMS = (16, 32, 64, 128)  # the head sizes the kernel is instantiated for (small
# ones for the test models)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Engine calls let the kernel size its work items by the threads it runs on.
AUTO_SPLIT = -1


def build_dir() -> Path:
    default = Path(__file__).resolve().parents[2] / ".build"
    return Path(os.environ.get("STALLFREE_BUILD_DIR", default))


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def build_tag() -> str:
    """What the library was compiled from and for; part of its file name."""
    h = hashlib.sha256(SOURCE.read_bytes())
    for part in (" ".join(CFLAGS), torch.__version__, platform.machine(), _cpu_flags()):
        h.update(part.encode())
    return h.hexdigest()[:16]


def library_path() -> Path:
    return build_dir() / f"paged_decode_{build_tag()}" / "paged_decode.so"


class KernelLoader:
    """Loads the library once; `reason` says why it is not in use (None: it is)."""

    def __init__(self) -> None:
        self.loaded = False
        self.enabled = os.environ.get("STALLFREE_PAGED_DECODE", "1") != "0"
        self.reason: str | None = "not loaded yet"
        self._tried = False

    def load(self) -> bool:
        if not self._tried:
            self._tried = True
            path = library_path()
            failure = path.with_suffix(".error")
            if path.exists():
                try:
                    torch.ops.load_library(str(path))
                    self.loaded, self.reason = True, None
                    logger.info("paged decode kernel loaded from %s", path)
                except (OSError, RuntimeError) as e:
                    self.reason = f"{path} did not load: {e}"
            elif failure.exists():
                self.reason = f"its build failed: {failure.read_text().strip()[-300:]}"
            else:
                self.reason = (f"not built for this source and CPU ({path} is missing; "
                               f"`make kernels` builds it)")
            if self.reason:
                logger.warning("paged decode kernel not in use: %s; decode attention "
                               "gathers KV blocks (torch path)", self.reason)
        return self.loaded


KERNEL = KernelLoader()


def unavailable_reason() -> str | None:
    """Why the kernel cannot run here (None: it is loaded)."""
    KERNEL.load()
    return KERNEL.reason


@contextmanager
def kernel_enabled(enabled: bool) -> Iterator[None]:
    """Decode attention in the kernel (True, where usable) or the torch path (False) inside
    the block: for comparisons and side-by-side benchmarks."""
    previous, KERNEL.enabled = KERNEL.enabled, enabled
    try:
        yield
    finally:
        KERNEL.enabled = previous


def usable(kv_cache: torch.Tensor) -> bool:
    """Whether decode attention over this layer's cache [2, blocks, bs, Hkv, D] runs in the
    kernel (the query is on the cache's device)."""
    return (KERNEL.enabled and kv_cache.device.type == "cpu" and kv_cache.dtype in DTYPES
            and kv_cache.shape[-1] in HEAD_DIMS and KERNEL.load())


def paged_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, split: int = AUTO_SPLIT
                 ) -> torch.Tensor:
    """q [B, Hq, D] against one layer's cache [2, blocks, block_size, Hkv, D]: row i sees
    its first context_lens[i] tokens through block_tables[i] (int64). Returns [B, Hq, D].

    `split`: tokens per work item (0: whole requests; AUTO_SPLIT: sized by the threads).
    """
    if not KERNEL.load():
        raise RuntimeError(f"paged decode kernel unavailable: {KERNEL.reason}")
    return torch.ops.stallfree.paged_decode(q, kv_cache, block_tables, context_lens, scale,
                                            split)
