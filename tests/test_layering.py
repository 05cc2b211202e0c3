"""The package's imports flow one way: entry points -> services -> llm -> engine -> ... -> config.

`layering.check_layering` reads the sources with ast (no torch); the rules are in
its docstring. The tables below are the architecture: edit them deliberately.
Run `python tests/layering.py` for the current violations, one a line.
"""
from __future__ import annotations

import importlib.util
import textwrap
from pathlib import Path

import pytest

from layering import check_layering, private_imports_from

PACKAGE_ROOT = Path(importlib.util.find_spec("stallfree").submodule_search_locations[0])
TESTS = Path(__file__).parent

# Bottom first. A unit (a top-level module or subpackage of stallfree) may import
# from any layer below its own; `__init__` is stallfree/__init__.py.
LAYERS = (
    ("foundation", "config sampling_params request outputs attention_plan detokenizer "
                   "iteration_log data structured_outputs huge_pages kernel_ops env"),
    ("core", "scheduler model request_group"),  # scheduler: pure Python (test_scheduler.py)
    ("execution", "executor distributed structured"),  # structured: xgrammar matchers
    ("engine", "engine"),
    ("offline API", "llm"),
    ("services", "server bench sim profiler"),
    ("entry points", "cli demo __main__ __init__"),
)

# Imports inside one layer fail unless listed here: importer -> what it may import
# (a unit, or one module of it such as "sim.profile_store").
SIDEWAYS = {
    "request": ("sampling_params",),
    "sampling_params": ("structured_outputs",),
    "outputs": ("attention_plan",),
    "iteration_log": ("outputs",),
    "config": ("kernel_ops",),             # checks the `kernels` setting's names
    "distributed": ("executor",),          # the distributed executor reuses the local one
    "sim": ("bench",),                     # shared workload and report code
    "profiler": ("sim",),                  # writes profiles, netting out the cost model
    "__main__": ("cli",),
}

# Never reached from the unit, not even through what it imports: the simulator
# runs no tensors, so it loads neither torch nor anything that runs the model; and it
# sends no requests, so the bench code it shares must not drag in the HTTP client.
FORBIDDEN = {
    "sim": ("torch", "stallfree.model", "stallfree.executor", "stallfree.distributed",
            "stallfree.engine", "stallfree.llm", "httpx", "stallfree.bench.client"),
}


def test_the_package_follows_its_layers():
    violations = check_layering(PACKAGE_ROOT, LAYERS, SIDEWAYS, FORBIDDEN)
    assert not violations, "\n".join(map(str, violations))


def test_the_tests_import_no_private_name_of_the_package():
    uses = private_imports_from(sorted(TESTS.glob("*.py")), PACKAGE_ROOT)
    assert not uses, "make these public (or test through the public API):\n" + "\n".join(uses)


# The checker itself, on small synthetic packages.

TOY_LAYERS = (("base", "config util"), ("core", "core"), ("top", "cli __init__"))


def make_package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "toy"
    for name, source in {"__init__.py": "", **files}.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
    return root


CLEAN = {
    "config.py": "import dataclasses\nLIMIT = 1\n",
    "util.py": "from .config import LIMIT\n",
    "core/__init__.py": "from .engine import Engine\n",
    "core/engine.py": """\
        from typing import TYPE_CHECKING

        from ..config import LIMIT
        from . import queue

        if TYPE_CHECKING:
            from .step import Step


        class Engine:
            def run(self):
                from .step import Step  # lazy, one way
                return Step(queue.Queue(), LIMIT)
        """,
    "core/queue.py": "class Queue:\n    pass\n",
    "core/step.py": """\
        from typing import TYPE_CHECKING

        if TYPE_CHECKING:  # a type-only way back is no cycle
            from .engine import Engine


        class Step:
            def __init__(self, queue, limit):
                self.queue = queue
        """,
    "cli.py": "import toy.core\nfrom toy.core.engine import Engine\n",
}


def check(tmp_path, files, sideways=None, forbidden=None):
    root = make_package(tmp_path, {**CLEAN, **files})
    return check_layering(root, TOY_LAYERS, sideways or {"util": ("config",)}, forbidden or {})


def kinds(violations) -> list[str]:
    return [v.kind for v in violations]


def test_a_clean_package_passes(tmp_path):
    assert check(tmp_path, {}) == []


def test_a_cycle_fails_even_through_a_lazy_import(tmp_path):
    violations = check(tmp_path, {"core/queue.py": """\
        def drain():
            from .engine import Engine
            return Engine
        """})
    assert kinds(violations) == ["cycle"]
    assert "toy.core.engine -> toy.core.queue -> toy.core.engine" in violations[0].message
    assert "core/queue.py:2 (in a function)" in violations[0].message


def test_a_cycle_through_a_package_init_fails(tmp_path):
    violations = check(tmp_path, {"core/queue.py": "from toy.core import Engine\n"})
    assert kinds(violations) == ["cycle"]
    assert "toy.core -> toy.core.engine -> toy.core.queue -> toy.core" in violations[0].message


def test_an_upward_import_fails(tmp_path):
    violations = check(tmp_path, {"config.py": "def f():\n    from .core import queue\n"})
    assert kinds(violations) == ["upward"]
    assert "toy/config.py:2 (in a function)" in violations[0].message
    assert "toy.config (base) imports toy.core.queue (core" in violations[0].message


def test_a_type_only_import_still_counts_as_upward(tmp_path):
    violations = check(tmp_path, {"config.py": """\
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from toy.core.step import Step
        """})
    assert kinds(violations) == ["upward"]
    assert "(type-only)" in violations[0].message


def test_a_sideways_import_fails_unless_listed(tmp_path):
    files = {"util.py": "X = 1\n", "config.py": "from .util import X\n"}
    assert kinds(check(tmp_path, files)) == ["sideways"]
    assert check(tmp_path, files, sideways={"config": ("util",)}) == []


def test_a_private_name_imported_across_modules_fails(tmp_path):
    violations = check(tmp_path, {
        "config.py": "_HIDDEN = 1\n",
        "util.py": "from .config import _HIDDEN\n",
        "cli.py": "from toy import config\nprint(config._HIDDEN)\n",
    })
    assert sorted(kinds(violations)) == ["private", "private"]
    assert "toy.util imports _HIDDEN from toy.config" in str(violations)
    assert "reads _HIDDEN of toy.config" in str(violations)


def test_a_private_module_is_for_its_own_package(tmp_path):
    files = {"core/_impl.py": "X = 1\n", "core/queue.py": "from ._impl import X\n"}
    assert check(tmp_path, files) == []
    violations = check(tmp_path, {**files, "cli.py": "from toy.core._impl import X\n"})
    assert kinds(violations) == ["private"]


def test_a_forbidden_import_fails_through_a_chain(tmp_path):
    violations = check(tmp_path, {"util.py": "import json\nfrom .config import LIMIT\n",
                                  "config.py": "def f():\n    import numpy\n"},
                       forbidden={"util": ("numpy", "json")})
    assert kinds(violations) == ["forbidden", "forbidden"]
    assert "util must not import numpy: toy.util -> toy.config -> numpy" in str(violations)


def test_a_unit_outside_the_table_fails_with_what_to_do(tmp_path):
    violations = check(tmp_path, {"plugins/__init__.py": ""})
    assert kinds(violations) == ["unplaced"]
    assert "toy.plugins is in no layer: add it to the layer table" in violations[0].message


def test_an_import_of_a_missing_module_fails(tmp_path):
    violations = check(tmp_path, {"cli.py": "def main():\n    from toy.gone import run\n"})
    assert kinds(violations) == ["unresolved"]


@pytest.mark.parametrize("source", ["from toy.config import _X\n",
                                    "import toy.config as c\nc._X\n"])
def test_tests_taking_private_names_are_reported(tmp_path, source):
    root = make_package(tmp_path, {"config.py": "_X = 1\n"})
    test_file = tmp_path / "test_toy.py"
    test_file.write_text(source)
    assert len(private_imports_from([test_file], root)) == 1
