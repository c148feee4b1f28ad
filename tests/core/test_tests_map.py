"""tests/README.md maps every feature to its test files: every test file is in the map, and every
file the map names exists (so the map cannot drift from the tree)."""

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def _named() -> set[str]:
    text = (TESTS / "README.md").read_text()
    return set(re.findall(r"`((?:core|integration|system|chaos|pytorch)/test_\w+\.py)`", text))


def test_every_test_file_is_in_the_map():
    files = {str(p.relative_to(TESTS)) for p in TESTS.glob("*/test_*.py")}
    missing = sorted(files - _named())
    assert not missing, f"tests/README.md does not map these test files: {missing}"


def test_every_file_the_map_names_exists():
    absent = sorted(n for n in _named() if not (TESTS / n).is_file())
    assert not absent, f"tests/README.md names files that do not exist: {absent}"
