"""Results derived from a model file, saved once under the build folder for later starts.

An entry is keyed by the file (path, size, modification time) and the versions of the
libraries that derived it, so an edited file or an upgrade makes a new one. Writes are
whole or not at all, and each kind keeps only its newest entries: tests write model
files of their own, each a new key.
"""
from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from .kernels import build_dir

ENTRIES_KEPT = 8


def entry(kind: str, path: str, *versions: str) -> Path:
    """Where `kind`'s result for the file at `path` lives (it may not exist yet)."""
    stat = os.stat(path)
    key = hashlib.sha256(repr((os.path.abspath(path), stat.st_size, stat.st_mtime_ns,
                               versions)).encode()).hexdigest()[:16]
    return build_dir() / kind / key


def publish(written: Path, final: Path) -> None:
    """Moves a finished temporary file or folder into place, then drops the kind's oldest
    entries. Raises OSError (e.g. another process published first); `written` is gone
    either way."""
    try:
        os.replace(written, final)
    finally:
        if written.is_dir():
            shutil.rmtree(written, ignore_errors=True)
        elif written.exists():
            written.unlink()
    entries = sorted(final.parent.iterdir(), key=lambda p: p.stat().st_mtime)
    for old in entries[:-ENTRIES_KEPT]:
        shutil.rmtree(old, ignore_errors=True) if old.is_dir() else old.unlink(missing_ok=True)
