"""Transparent huge pages for torch's large CPU buffers: the weights and the KV cache.

Every decode step streams the weights and the KV cache from memory. On 4 KiB pages each
scattered KV block costs TLB misses, and the hardware prefetchers stop at every page
boundary. Linux backs memory with 2 MiB pages when THP is "always", or under "madvise"
(a common default) where the program advises it. torch advises its allocations of 2 MiB
and more when THP_MEM_ALLOC_ENABLE=1, which it reads once, as it loads: so importing
stallfree sets it, before anything imports torch (docs/benchmarks.md has what it buys).
No torch here: the package's first import must not load it.
"""
from __future__ import annotations

import os
import re
import sys
from collections.abc import MutableMapping

THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"
TORCH_SWITCH = "THP_MEM_ALLOC_ENABLE"
_set_here = False  # whether this module set the switch before torch loaded
_torch_first = False  # whether torch had loaded, unadvised, before stallfree could set it


def thp_mode(path: str = THP_SETTING) -> str | None:
    """The kernel's THP mode (always, madvise or never), None where there is none."""
    try:
        with open(path) as f:
            match = re.search(r"\[(\w+)\]", f.read())
    except OSError:
        return None
    return match.group(1) if match else None


def request_for_torch(environ: MutableMapping[str, str] = os.environ,
                      torch_loaded: bool | None = None, path: str = THP_SETTING) -> bool:
    """Turns on torch's huge-page advice where it would take effect and nobody chose;
    True when it did."""
    global _set_here, _torch_first
    loaded = "torch" in sys.modules if torch_loaded is None else torch_loaded
    if TORCH_SWITCH in environ or thp_mode(path) != "madvise":
        return False
    if loaded:
        _torch_first = True
        return False
    environ[TORCH_SWITCH] = "1"
    _set_here = True
    return True


def status(environ: MutableMapping[str, str] = os.environ, path: str = THP_SETTING) -> str:
    """Whether torch's big buffers get huge pages, and why: for the start-up log and the
    engine_info metric."""
    mode = thp_mode(path)
    if mode is None:
        return "off: this kernel has no transparent huge pages"
    if mode == "never":
        return f"off: THP is 'never' ({path})"
    if mode == "always":
        return "on: THP is 'always'"
    if _torch_first:  # whatever the switch says now, torch read it before anyone set it
        return (f"off: torch was imported before stallfree, too early for {TORCH_SWITCH}=1 "
                f"(import stallfree first, or set {TORCH_SWITCH}=1 before Python starts)")
    if environ.get(TORCH_SWITCH) != "1":
        return f"off: {TORCH_SWITCH} is not 1"
    if _set_here:
        return "on: THP 'madvise', torch advised"
    return f"on: THP 'madvise', {TORCH_SWITCH}=1 given"


def torch_was_first() -> bool:
    """Whether torch loaded before stallfree where the switch would have mattered: the
    engine warns then, since its buffers miss huge pages for an import's order."""
    return _torch_first


def huge_page_mib(path: str = "/proc/self/smaps_rollup") -> float | None:
    """This process's memory in transparent huge pages, MiB (None where unknown)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None
