"""README's layout block ("How it is built") against the package's tree: text only.

Each line indented two spaces starts with top-level units (`config.py ...`, `server/`); a
package may be followed by some of its files (`server/ api.py routes/`), and lines
indented further name more files of the package above. Every module and package
directly under stallfree/ must be named, and every name must exist, so the block cannot
drift as units come and go.
"""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parent.parent
PACKAGE = ROOT / "stallfree"
NAME = re.compile(r"^[\w.]+(\.py|/)$")  # a module or a package, as the block writes them


def layout_block() -> list[str]:
    after = (ROOT / "README.md").read_text().split("## How it is built", 1)[1]
    return after.split("```", 2)[1].strip("\n").splitlines()


def parse(lines: list[str]) -> tuple[set[str], list[tuple[str, str]]]:
    """The top-level names, and (unit, file) for the files named under a unit."""
    top: set[str] = set()
    files: list[tuple[str, str]] = []
    unit = None
    for line in lines[1:]:  # the first is "stallfree/"
        # Names come before the description: in the first two columns (2+ spaces apart).
        columns = re.split(r"\s{2,}", line.strip())
        names = [w for c in columns[:2] for w in c.split() if NAME.match(w)]
        if re.match(r"  \S", line):  # a line of units; a module after a package is its file
            split = next((i for i in range(1, len(names))
                          if names[i].endswith(".py") and names[i - 1].endswith("/")),
                         len(names))
            top.update(names[:split])
            unit = names[0] if split == 1 and names[0].endswith("/") else None
            names = names[split:]
        files.extend((unit, n) for n in names if unit is not None)
    return top, files


def top_level_units() -> set[str]:
    return {p.name + "/" if p.is_dir() else p.name for p in PACKAGE.iterdir()
            if (p.is_dir() and p.name != "__pycache__") or p.suffix == ".py"}


def test_the_readme_layout_names_every_top_level_unit():
    named, _ = parse(layout_block())
    assert not top_level_units() - named, "add these to README's layout block"
    assert not named - top_level_units(), "README's layout block names what is gone"


def test_the_files_the_readme_layout_names_exist():
    _, files = parse(layout_block())
    assert files, "the block names no file inside a unit: is the parser still right?"
    missing = [f"{unit}{name}" for unit, name in files if not (PACKAGE / unit / name).exists()]
    assert not missing, missing
