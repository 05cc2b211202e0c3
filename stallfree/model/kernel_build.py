"""Builds the CPU kernels (csrc/*.cpp) where kernels.py looks for them.

Run: python -m stallfree.model.kernel_build   (the Makefile's `kernels` step)

A setuptools build through torch.utils.cpp_extension (ninja when present, else plain
compiler calls): no network. Up to date: returns at once. No compiler, or a failed
compile: the reason goes to `<library>.error` beside where the library would be, the
command still exits 0 and the engine keeps its torch path, saying why when it starts.
"""
from __future__ import annotations

import contextlib
import io
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from .kernels import CFLAGS, LIBRARY_NAME, SOURCES, build_dir, library_path


def build() -> tuple[Path | None, str]:
    """(library, what happened); library is None when it could not be built."""
    target = library_path()
    if target.exists():
        return target, f"up to date: {target}"
    for pattern in (f"{LIBRARY_NAME}_*", "paged_decode_*"):  # older sources, CPUs or names
        for stale in build_dir().glob(pattern):
            shutil.rmtree(stale, ignore_errors=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    failure = target.with_suffix(".error")
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        failure.write_text(f"no C++ compiler ({compiler}) on PATH\n")
        return None, failure.read_text().strip()
    started = time.perf_counter()
    log = io.StringIO()
    try:
        from setuptools import setup
        from torch.utils.cpp_extension import BuildExtension, CppExtension

        ext = CppExtension(LIBRARY_NAME, [str(s) for s in SOURCES], extra_compile_args=list(CFLAGS),
                           extra_link_args=["-fopenmp"])
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp, \
                contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            # From an empty folder: setuptools would read the repository's pyproject.toml.
            cwd = os.getcwd()
            os.chdir(tmp)
            try:
                setup(name="stallfree-kernels", ext_modules=[ext],
                      cmdclass={"build_ext": BuildExtension},
                      script_args=["-q", "build_ext", "--build-lib", tmp,
                                   "--build-temp", os.path.join(tmp, "obj")])
            finally:
                os.chdir(cwd)
            built = next(Path(tmp).glob(f"{LIBRARY_NAME}*.so"))
            os.replace(built, target)
    except (Exception, SystemExit) as e:  # noqa: BLE001 - any failure leaves the torch path
        failure.write_text(f"{type(e).__name__}: {e}\n{log.getvalue()[-4000:]}")
        return None, f"build failed ({type(e).__name__}: {e}); details in {failure}"
    failure.unlink(missing_ok=True)
    return target, f"built {target} in {time.perf_counter() - started:.1f} s"


def main() -> int:
    library, message = build()
    print(f"CPU kernels: {message}", file=sys.stdout if library else sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
