"""The CPU kernels (csrc/*.cpp, one library): where their build lives, loading it, and what
this CPU lets them run (which of them run is the kernel table's choice, kernel_table.py).

`make` builds the library into `.build/` at the repository root (`python -m
stallfree.model.kernel_build`; STALLFREE_BUILD_DIR moves it). Its name carries a hash of
the sources, the compile flags, torch's version and this CPU's flags, since it is compiled
for this CPU (-march=native, unless STALLFREE_KERNEL_MARCH names another target): a library
built elsewhere or from older sources is never loaded. Without it (no compiler, a failed
build) every kernel's caller takes its torch path, which stays the reference; the first
time, one log line says why.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import platform
from pathlib import Path

import torch

from .. import env

logger = logging.getLogger("stallfree.model")

SOURCES = tuple(sorted((Path(__file__).resolve().parent / "csrc").glob("*.cpp")))
HEADERS = tuple(sorted((Path(__file__).resolve().parent / "csrc").glob("*.h")))
# -O3 and the host's vector width: the kernels are plain loops and GCC vector types.
# STALLFREE_KERNEL_MARCH builds for another target (x86-64-v3: the AVX2-only machines'
# code, run on a wider CPU to check it); it is in the build tag with the other flags.
MARCH = env.kernel_march()
CFLAGS = ("-O3", f"-march={MARCH}", "-fopenmp", "-g0")
LIBRARY_NAME = "kernels"


def build_dir() -> Path:
    default = Path(__file__).resolve().parents[2] / ".build"
    return env.build_dir(default)


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def build_tag() -> str:
    """What the library was compiled from and for; part of its file name."""
    h = hashlib.sha256()
    for source in SOURCES + HEADERS:
        h.update(source.read_bytes())
    for part in (" ".join(CFLAGS), torch.__version__, platform.machine(), _cpu_flags()):
        h.update(part.encode())
    return h.hexdigest()[:16]


def library_path() -> Path:
    return build_dir() / f"{LIBRARY_NAME}_{build_tag()}" / f"{LIBRARY_NAME}.so"


class KernelLibrary:
    """Loads the library once; `reason` says why it is not in use (None: it is)."""

    def __init__(self) -> None:
        self.loaded = False
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
                    logger.info("CPU kernels loaded from %s", path)
                except (OSError, RuntimeError) as e:
                    self.reason = f"{path} did not load: {e}"
            elif failure.exists():
                self.reason = f"its build failed: {failure.read_text().strip()[-300:]}"
            else:
                self.reason = (f"not built for these sources and CPU ({path} is missing; "
                               f"`make kernels` builds it)")
            if self.reason:
                logger.warning("CPU kernels not in use: %s; decode attention gathers KV "
                               "blocks and matmuls run in torch (torch paths)", self.reason)
        return self.loaded


LIBRARY = KernelLibrary()


def unavailable_reason() -> str | None:
    """Why the kernels cannot run here (None: they are loaded)."""
    LIBRARY.load()
    return LIBRARY.reason


AMX_FLAGS = ("amx_tile", "amx_bf16")


def missing_cpu_flags(flags: tuple[str, ...]) -> list[str]:
    """Those of `flags` this CPU's /proc/cpuinfo does not list."""
    have = _cpu_flags().split()
    return [f for f in flags if f not in have]


@functools.cache
def bf16_vectors_unavailable_reason() -> str | None:
    """Why the kernels' AVX512_BF16 vector paths cannot run here (None: they can)."""
    if unavailable_reason() is not None:
        return f"kernels not built: {LIBRARY.reason}"
    if missing_cpu_flags(("avx512_bf16",)):
        return "this CPU lacks avx512_bf16"
    if not torch.ops.stallfree.bf16_vectors_built():
        return (f"the kernels were compiled without AVX512_BF16 (-march={MARCH}: a target "
                "or a compiler that lacks it)")
    return None


@functools.cache
def amx_unavailable_reason() -> str | None:
    """Why the AMX paths of the kernels cannot run here (None: they can): no library, a CPU
    without the flags, or the OS refusing this process the tile registers. Fixed for the
    process, so asked once (every weight's packing asks)."""
    if unavailable_reason() is not None:
        return f"kernels not built: {LIBRARY.reason}"
    lacking = missing_cpu_flags(AMX_FLAGS)
    if lacking:
        return f"this CPU lacks {' and '.join(lacking)}"
    if not torch.ops.stallfree.amx_usable():
        return "the OS refused this process the AMX tile registers (arch_prctl)"
    return None


@functools.cache
def onednn_bf16_unavailable_reason() -> str | None:
    """Why oneDNN cannot take bf16 weights here (None: it can). AVX2-only CPUs lack what
    its bf16 path needs, and a prepack there raises."""
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn)"
    try:
        supported = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    except (AttributeError, RuntimeError):  # a torch build without the op
        supported = False
    if not supported:
        return ("oneDNN's bf16 path needs avx512bw, avx512vl and avx512dq, or avx_ne_convert: "
                "this CPU (or ONEDNN_MAX_CPU_ISA) has neither")
    return None


def vector_flags() -> str:
    """This CPU's vector and matrix flags (avx*, amx*, fma), sorted: what decides the
    kernels' paths, and what every benchmark records beside its numbers."""
    return " ".join(sorted({f for f in _cpu_flags().split()
                            if f.startswith(("avx", "amx", "fma"))}))
