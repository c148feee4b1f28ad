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


#: the packages whose every module is placed in a layer (pyproject.toml, [tool.importlinter])
PACKAGES = ("adamps", "controller", "coordinator", "dataserver", "trainer")


def layered_contracts() -> list[dict]:
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    return [c for c in contracts["contracts"] if c["type"] == "layers"]


def placed() -> dict[str, set[str]]:
    """package -> the names of its modules that a layered contract places in a layer: its own
    contract's (containers), or a contract's that names them in full (no containers)."""
    out: dict[str, set[str]] = {}
    for contract in layered_contracts():
        names = {n.strip() for layer in contract["layers"] for n in layer.split("|")}
        for container in contract.get("containers", [""]):
            for name in names:
                full = f"{container}.{name}" if container else name
                parent, _, child = full.rpartition(".")
                out.setdefault(parent, set()).add(child)
    return out


def children(package: str) -> set[str]:
    d = ROOT / package.replace(".", "/")
    found = {p.stem for p in d.glob("*.py") if p.name != "__init__.py"}
    return found | {p.name for p in d.iterdir() if (p / "__init__.py").is_file()}


def packages() -> list[str]:
    return sorted(
        ".".join(p.parent.relative_to(ROOT).parts)
        for top in PACKAGES
        for p in (ROOT / top).rglob("__init__.py")
    )


def test_every_module_is_in_a_layer_of_its_package() -> None:
    """A module added to any package is placed in its package's layers (issue 41: contracts over
    every module), so that what it may import, and what may import it, is written down."""
    found = packages()
    assert {"adamps.server.decode", "controller", "trainer", "dataserver"} <= set(found)
    where = placed()
    unplaced = [
        f"{pkg}.{c}" for pkg in found for c in sorted(children(pkg) - where.get(pkg, set()))
    ]
    assert not unplaced, f"in no layer of a layered contract of their package: {unplaced}"


def test_every_layer_names_a_module_that_exists() -> None:
    """No layer for a module that is gone (nor an optional "(name)" layer kept for a module of
    another branch): a contract names what the code has."""
    where = placed()
    optional = sorted(n for pkg in where for n in where[pkg] if n.startswith("("))
    assert not optional, f"optional layers: place the module, or drop the layer: {optional}"
    missing = sorted(f"{pkg}.{n}" for pkg, names in where.items() for n in names - children(pkg))
    assert not missing, f"layers naming no module: {missing}"
