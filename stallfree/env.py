"""The one module that reads stallfree's environment variables: process-level facts only.

Which kernel runs each op is an engine setting (`kernels`, stallfree/kernel_ops.py), so two
engines in one process may differ. What is left here holds for the whole process, or
for a process before any engine exists: how the kernel library is built and where it
lives, the secret a worker process is started with, and the server's start-up.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

# The compiler's -march for the kernel library (another target, e.g. x86-64-v3, runs the
# AVX2-only machines' code on a wider CPU to check it): a build fact, in the build tag.
KERNEL_MARCH = "STALLFREE_KERNEL_MARCH"
BUILD_DIR = "STALLFREE_BUILD_DIR"  # where the kernel library is built (default: .build/)
# The secret of a tensor/pipeline-parallel run, given to a worker process before it can
# hear anything from the engine: hex, or the name of a file holding it.
WORKER_SECRET = "STALLFREE_WORKER_SECRET"
WORKER_SECRET_FILE = "STALLFREE_WORKER_SECRET_FILE"
API_KEY = "STALLFREE_API_KEY"  # the server's key, kept out of the command line (and `ps`)
# "0": a server leaves its start-up objects in the cyclic GC's passes (a process-wide heap).
GC_FREEZE = "STALLFREE_GC_FREEZE"


def kernel_march(environ: Mapping[str, str] = os.environ) -> str:
    return environ.get(KERNEL_MARCH, "native")


def build_dir(default: Path, environ: Mapping[str, str] = os.environ) -> Path:
    return Path(environ.get(BUILD_DIR, default))


def worker_secret_text(environ: Mapping[str, str] | None = None) -> str | None:
    """The run's secret as given (hex), from $STALLFREE_WORKER_SECRET or the file named by
    $STALLFREE_WORKER_SECRET_FILE; None if neither is set."""
    environ = os.environ if environ is None else environ
    text = environ.get(WORKER_SECRET)
    if not text and environ.get(WORKER_SECRET_FILE):
        with open(environ[WORKER_SECRET_FILE]) as f:
            text = f.read()
    return text or None


def api_key(environ: Mapping[str, str] = os.environ) -> str | None:
    return environ.get(API_KEY)


def gc_freeze(environ: Mapping[str, str] = os.environ) -> bool:
    return environ.get(GC_FREEZE) != "0"
