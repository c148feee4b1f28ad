"""Folders that show the architecture (issue 41): no folder under adamps/ holds more than 15
modules, each folder says in its `__init__` docstring what it owns and what it may import, and
each module of a layered folder is in one of its layers (pyproject.toml, [tool.importlinter]),
so that a module added to a folder is placed in its layers, not left outside every contract."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: the most modules of one folder (its `__init__.py` not counted)
FOLDER_LIMIT = 15


def folders() -> list[Path]:
    top = ROOT / "adamps"
    return [top, *sorted(p.parent for p in top.rglob("__init__.py") if p.parent != top)]


def test_no_folder_under_adamps_has_more_than_15_modules() -> None:
    found = folders()
    assert len(found) > 10, "the walk found too few folders: is ROOT the repository?"
    over = {
        str(d.relative_to(ROOT)): n
        for d in found
        if (n := sum(1 for p in d.glob("*.py") if p.name != "__init__.py")) > FOLDER_LIMIT
    }
    assert not over, f"split these folders by concept (limit {FOLDER_LIMIT} modules): {over}"


def test_every_folder_has_an_init_docstring() -> None:
    missing = [
        str(d.relative_to(ROOT))
        for d in folders()
        if not (d / "__init__.py").is_file()
        or not ast.get_docstring(ast.parse((d / "__init__.py").read_text()))
    ]
    # a folder of modules without an __init__.py is a namespace package: found here too
    missing += [
        str(p.parent.relative_to(ROOT))
        for p in (ROOT / "adamps").rglob("*.py")
        if not (p.parent / "__init__.py").is_file()
    ]
    assert not missing, f"these folders say nothing of what they own and import: {missing}"


def test_every_module_of_a_layered_folder_is_in_a_layer() -> None:
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    layered = [c for c in contracts["contracts"] if c["type"] == "layers" and "containers" in c]
    assert any(c["containers"] == ["adamps.server"] for c in layered)
    unplaced = []
    for contract in layered:
        # "(name)": an optional layer (import-linter), a module some checkouts do not have yet
        names = {n.strip().strip("()") for layer in contract["layers"] for n in layer.split("|")}
        for container in (c for c in contract["containers"] if c.startswith("adamps")):
            d = ROOT / container.replace(".", "/")
            children = {p.stem for p in d.glob("*.py") if p.name != "__init__.py"}
            children |= {p.name for p in d.iterdir() if (p / "__init__.py").is_file()}
            unplaced += [f"{container}.{c} ({contract['id']})" for c in sorted(children - names)]
    assert not unplaced, f"in no layer of their folder's contract: {unplaced}"
