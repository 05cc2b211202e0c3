"""A static check of a package's import structure: layers, cycles and private names.

It reads the source with `ast` and imports nothing, so it runs without torch and
sees lazy imports (inside functions) that a runtime check would miss.

Rules, checked by `check_layering(root, layers, sideways, forbidden)`:

- **cycle**: no two modules import each other, directly or through others.
  Imports inside functions count (a lazy import is still a dependency, and a
  cycle through one breaks as soon as someone moves it to the top). Imports
  under `if TYPE_CHECKING:` do not count for cycles: they never run, so they
  cannot cause a half-initialised module, and one from a lower layer to a
  higher one is already reported as an upward import.
- **upward**: a module imports only from its own unit or from a lower layer.
  A unit is a top-level module or subpackage of the package (`engine`,
  `scheduler`); the package's own `__init__.py` is the unit `__init__`.
  Type-only imports count here: a lower layer naming an upper layer's type
  depends on it all the same.
- **sideways**: units of one layer do not import each other unless `sideways`
  lists the pair (prefixes such as `"sim.profile_store"` narrow it to a module).
- **forbidden**: what `forbidden` lists for a unit (third-party or internal,
  as absolute module-name prefixes) is never reached from that unit, not even
  through the modules it imports; the message shows the chain.
- **private**: no `_name` is imported from another module (`from .x import _y`)
  or read off an imported module (`x._y`); a `_module` is imported only from
  inside its own package. Shared names are made public instead.
- **unplaced**: every unit is in the layer table, so new packages get placed
  deliberately.
- **unresolved**: an import of a module of the package that does not exist
  (a stale lazy import left behind by a move).
"""
from __future__ import annotations

import ast
import os
import sys
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

Layers = Sequence[tuple[str, str]]  # (layer name, space-separated units), bottom first


@dataclass(frozen=True)
class Import:
    """One imported module (or name from a module) as written in one file."""

    importer: str       # dotted name of the importing module
    target: str         # dotted name of the imported module
    name: str | None    # the name taken from `target` by `from target import name`
    alias: str | None   # the local name bound to the module `target`, if one is
    path: Path
    line: int
    lazy: bool          # inside a function: runs when called, not when imported
    type_only: bool     # under `if TYPE_CHECKING:`: never runs

    @property
    def where(self) -> str:
        how = " (type-only)" if self.type_only else " (in a function)" if self.lazy else ""
        return f"{self.path}:{self.line}{how}"


@dataclass(frozen=True)
class Violation:
    kind: str  # cycle, upward, sideways, forbidden, private, unplaced, unresolved
    message: str

    def __str__(self) -> str:
        return f"{self.kind}: {self.message}"


def module_index(root: Path) -> dict[str, Path]:
    """Dotted module name -> source file, for every .py file under the package root."""
    index = {}
    for path in sorted(root.rglob("*.py")):
        parts = [root.name, *path.relative_to(root).with_suffix("").parts]
        if "__pycache__" in parts:
            continue
        if parts[-1] == "__init__":
            parts.pop()
        index[".".join(parts)] = path
    return index


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


def _walk(nodes: Iterable[ast.AST], lazy: bool = False, type_only: bool = False):
    """Yields (import node, lazy, type_only) for every import in nodes and below."""
    for node in nodes:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node, lazy, type_only
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _walk(node.body, lazy, True)
            yield from _walk(node.orelse, lazy, type_only)
        else:
            yield from _walk(ast.iter_child_nodes(node), lazy or isinstance(node, _SCOPES),
                             type_only)


def imports_of(tree: ast.Module, path: Path, module: str | None,
               index: Mapping[str, Path]) -> list[Import]:
    """Every import in one parsed file, relative ones resolved against `module`.

    `from pkg import name` names the module `pkg.name` when that is a module of
    the package, else the name `name` of the module `pkg`.
    """
    parts = (module or "").split(".")
    package = parts if path.name == "__init__.py" else parts[:-1]
    found = []
    for node, lazy, type_only in _walk([tree]):
        taken = []  # (target, name, alias)
        if isinstance(node, ast.Import):
            # `import a.b` binds `a`, not the module a.b
            taken = [(a.name, None, a.asname or (None if "." in a.name else a.name))
                     for a in node.names]
        else:
            base = package[:len(package) - node.level + 1] if node.level else []
            source = ".".join(base + ([node.module] if node.module else []))
            for a in node.names:
                submodule = f"{source}.{a.name}"
                taken.append((submodule, None, a.asname or a.name) if submodule in index
                             else (source, a.name, None))
        found += [Import(module or path.stem, target, name, alias, path, node.lineno, lazy,
                         type_only) for target, name, alias in taken]
    return found


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def private_uses(tree: ast.Module, path: Path, imports: Sequence[Import],
                 index: Mapping[str, Path]) -> list[str]:
    """`_names` that one parsed file takes from other modules of the package."""
    found = []
    bound = {}  # local name -> module of the package it is bound to
    for imp in imports:
        if imp.target not in index or imp.target == imp.importer:
            continue
        if imp.alias:
            bound[imp.alias] = imp.target
        if imp.name is not None and _is_private(imp.name):
            found.append(f"{imp.where}: {imp.importer} imports {imp.name} from {imp.target}")
        parts = imp.target.split(".")
        for i, part in enumerate(parts):
            owner = ".".join(parts[:i])
            if _is_private(part) and not (imp.importer + ".").startswith(owner + "."):
                found.append(f"{imp.where}: {imp.importer} imports the private module "
                             f"{'.'.join(parts[:i + 1])} from outside {owner}")
                break
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in bound and _is_private(node.attr)):
            found.append(f"{path}:{node.lineno}: reads {node.attr} of {bound[node.value.id]}")
    return found


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _matches(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


Graph = Mapping[str, Mapping[str, Import]]  # module -> imported module -> the import


def _shortest_chain(edges: Graph, starts: Iterable[str], goal: Callable[[str], bool],
                    within: set[str] | None = None) -> list[Import]:
    """The fewest imports leading from one of starts to a module for which goal holds."""
    came_from: dict[str, Import | None] = dict.fromkeys(starts)
    queue = deque(sorted(came_from))
    while queue:
        node = queue.popleft()
        for child, imp in sorted(edges.get(node, {}).items()):
            if goal(child):
                chain = [imp]
                while came_from[chain[-1].importer] is not None:
                    chain.append(came_from[chain[-1].importer])
                return chain[::-1]
            if child not in came_from and (within is None or child in within):
                came_from[child] = imp
                queue.append(child)
    return []


def _describe(chain: Sequence[Import]) -> str:
    steps = " -> ".join([chain[0].importer] + [imp.target for imp in chain])
    return f"{steps} ({', '.join(imp.where for imp in chain)})"


def _cycles(edges: Graph) -> list[list[Import]]:
    """One shortest cycle for each set of modules that import each other."""
    reach = {m: {i.target for i in _reachable(edges, m)} for m in edges}
    placed: set[str] = set()
    cycles = []
    for module in sorted(edges):
        if module in placed or module not in reach[module]:
            continue
        tangle = {m for m in reach[module] if module in reach.get(m, ())}
        placed |= tangle
        cycles.append(_shortest_chain(edges, [module], module.__eq__, tangle))
    return cycles


def _reachable(edges: Graph, start: str) -> list[Import]:
    seen: dict[str, Import] = {}
    queue = deque([start])
    while queue:
        for child, imp in edges.get(queue.popleft(), {}).items():
            if child not in seen:
                seen[child] = imp
                queue.append(child)
    return list(seen.values())


def _direction(imp: Import, package: str, layer_of: Mapping[str, tuple[int, str]],
               sideways: Mapping[str, Sequence[str]]) -> Violation | None:
    """An upward or unlisted sideways import between two units, or None."""
    source, target = _unit(imp.importer), _unit(imp.target)
    if source == target or source not in layer_of or target not in layer_of:
        return None
    (low, low_name), (high, high_name) = layer_of[source], layer_of[target]
    if high > low:
        return Violation("upward", f"{imp.where}: {imp.importer} ({low_name}) imports "
                         f"{imp.target} ({high_name}, a higher layer)")
    allowed = sideways.get(source, ())
    if high == low and not any(_matches(imp.target, f"{package}.{a}") for a in allowed):
        return Violation("sideways", f"{imp.where}: {imp.importer} imports {imp.target}, a unit "
                         f"of its own layer ({low_name}) that the sideways table does not allow")
    return None


def check_layering(root: Path, layers: Layers, sideways: Mapping[str, Sequence[str]] | None = None,
                   forbidden: Mapping[str, Sequence[str]] | None = None) -> list[Violation]:
    """Every violation of the rules in this module's docstring by the package at root.

    layers: (name, "unit unit ...") bottom first. sideways: unit -> same-layer
    units or modules (relative to the package, e.g. "sim.profile_store") it may
    import. forbidden: unit -> absolute module-name prefixes it must never reach.
    """
    root, sideways, forbidden = Path(root), sideways or {}, forbidden or {}
    package, index = root.name, module_index(root)
    layer_of = {unit: (i, name) for i, (name, units) in enumerate(layers)
                for unit in units.split()}
    violations = [Violation("unplaced", f"{package}.{unit} is in no layer: add it to the layer "
                            "table (where it may import from, who may import it)")
                  for unit in sorted({_unit(m) for m in index} - set(layer_of))]
    # Imports that run (lazy ones too), including third-party targets, which import nothing here.
    runtime: dict[str, dict[str, Import]] = {}
    for module, path in index.items():
        tree = ast.parse(path.read_text(), str(path))
        shown = path.relative_to(root.parent)
        found = imports_of(tree, shown, module, index)
        for imp in found:
            internal = _matches(imp.target, package)
            if internal and imp.target not in index:
                violations.append(Violation("unresolved", f"{imp.where}: {module} imports "
                                            f"{imp.target}, which is no module of {package}"))
                continue
            if imp.target == module:
                continue
            if not imp.type_only:
                runtime.setdefault(module, {}).setdefault(imp.target, imp)
            if internal and (wrong := _direction(imp, package, layer_of, sideways)):
                violations.append(wrong)
        violations += [Violation("private", use)
                       for use in private_uses(tree, shown, found, index)]
    violations += [Violation("cycle", _describe(cycle)) for cycle in _cycles(runtime)]
    for unit, prefixes in sorted(forbidden.items()):
        modules = [m for m in index if _unit(m) == unit]
        for prefix in prefixes:
            if chain := _shortest_chain(runtime, modules, lambda m, p=prefix: _matches(m, p)):
                violations.append(Violation(
                    "forbidden", f"{unit} must not import {prefix}: {_describe(chain)}"))
    return violations


def private_imports_from(files: Iterable[Path], root: Path) -> list[str]:
    """`_names` that files outside the package (tests, scripts) take from it."""
    index = module_index(Path(root))
    found = []
    for path in files:
        tree = ast.parse(path.read_text(), str(path))
        shown = Path(os.path.relpath(path, Path(root).parent))
        found += private_uses(tree, shown, imports_of(tree, shown, None, index), index)
    return found


if __name__ == "__main__":  # python tests/layering.py: the package's violations, one a line
    sys.path.insert(0, str(Path(__file__).parent))
    from test_layering import FORBIDDEN, LAYERS, PACKAGE_ROOT, SIDEWAYS

    for violation in check_layering(PACKAGE_ROOT, LAYERS, SIDEWAYS, FORBIDDEN):
        print(violation)
