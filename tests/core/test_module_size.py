"""Module size limits (issue 26): a module is one concept, so none outside tests/ and benchmarks/
grows past 600 lines; a module that needs more holds two concepts and is split by them."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: the most lines of one module outside tests/ and benchmarks/
MODULE_LIMIT = 600
#: directories whose modules are not held to the limit (and tools' and environments' own trees)
EXEMPT = {"tests", "benchmarks", ".git", ".venv", "venv", "build", "node_modules"}


def lines(path: Path) -> int:
    with path.open("rb") as f:
        return sum(1 for _ in f)


def modules() -> list[Path]:
    return [
        p
        for p in ROOT.rglob("*.py")
        if not EXEMPT.intersection(p.relative_to(ROOT).parts)
        and not any(part.startswith(".") for part in p.relative_to(ROOT).parts)
    ]


def test_no_module_outside_tests_and_benchmarks_is_over_600_lines() -> None:
    found = modules()
    assert len(found) > 100, "the walk found too few modules: is ROOT the repository?"
    over = {str(p.relative_to(ROOT)): n for p in found if (n := lines(p)) > MODULE_LIMIT}
    assert not over, f"split these by concept (limit {MODULE_LIMIT} lines): {over}"
