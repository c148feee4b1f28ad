"""Plain words for users (issue 37): no issue number in a string a user reads (help texts, log
and error messages, metric descriptions: every string constant of the packages that is not a
docstring; comments and docstrings may keep them), and `--host` is every role's listen flag."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ["adamps", "controller", "dataserver", "trainer", "coordinator"]
ISSUE = re.compile(r"\bissues? \d+")


def user_strings(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text())
    docs: set[int] = set()
    for node in ast.walk(tree):  # docstrings and other bare string statements are for readers
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            docs.add(id(node.value))
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs
    ]


def test_no_issue_numbers_in_user_facing_strings() -> None:
    found = [
        f"{p.relative_to(ROOT)}:{line}: {text[:80]!r}"
        for pkg in PACKAGES
        for p in sorted((ROOT / pkg).rglob("*.py"))
        for line, text in user_strings(p)
        if ISSUE.search(text)
    ]
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    "role", ["controller.main", "adamps.server.main", "dataserver.main", "trainer.main",
             "coordinator.main"],
)  # fmt: skip
def test_every_role_listens_on_host(role: str) -> None:
    import importlib

    parser = importlib.import_module(role).build_parser()
    ns = parser.parse_args(["--host", "10.1.2.3"])
    dest = "bind_host" if role == "controller.main" else "host"
    assert getattr(ns, dest) == "10.1.2.3"
    if role == "controller.main":  # the old flag still works
        assert parser.parse_args(["--bind-host", "10.1.2.4"]).bind_host == "10.1.2.4"
