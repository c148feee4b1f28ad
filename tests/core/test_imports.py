"""No import cycle between the four packages (issue 17): `adamps` is the shared base, and the roles
(`controller`, `dataserver`, `trainer`) build on it, never the other way round. Only the console
script (`adamps.cli`), which dispatches to every role, imports them. Checked on the source (every
import statement, lazy ones inside functions included), without importing anything."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("adamps", "controller", "coordinator", "dataserver", "trainer")
#: modules allowed to import any role: they exist to start them
ENTRY_POINTS = {"adamps.cli"}


def imports() -> dict[str, set[str]]:
    """module -> top-level packages of this project it imports."""
    out: dict[str, set[str]] = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            found = set()
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                found |= {n.split(".")[0] for n in names if n.split(".")[0] in PACKAGES}
            out[module] = found
    return out


def test_the_shared_package_imports_no_role() -> None:
    bad = {
        m: sorted(deps - {"adamps"})
        for m, deps in imports().items()
        if m.startswith("adamps.") and m not in ENTRY_POINTS and deps - {"adamps"}
    }
    assert not bad, f"adamps modules importing a role package: {bad}"


def test_the_packages_import_each_other_without_a_cycle() -> None:
    graph: dict[str, set[str]] = {p: set() for p in PACKAGES}
    for module, deps in imports().items():
        if module in ENTRY_POINTS:
            continue
        graph[module.split(".")[0]] |= deps - {module.split(".")[0]}
    done: set[str] = set()

    def visit(p: str, path: tuple[str, ...]) -> None:
        assert p not in path, f"import cycle: {' -> '.join((*path, p))}"
        if p in done:
            return
        for q in sorted(graph[p]):
            visit(q, (*path, p))
        done.add(p)

    for p in PACKAGES:
        visit(p, ())
