"""Import structure (issue 17), as import-linter contracts in pyproject.toml ([tool.importlinter]):

- no import cycle between the four packages: `adamps` is the shared base, the roles
  (`controller`, `dataserver`, `trainer`) build on it, never the other way round; only the console
  script (`adamps.cli`), which dispatches to every role, may import them;
- adamps in layers of folders (issue 41), and the parameter server's folders in layers: api/
  -> the write and read paths -> replication/ -> storage/ (LMDB) -> store/ -> updates/, each
  folder in layers of its own; HTTP and the data plane reach the owner threads and the
  replication rounds only through the write and read paths;
- the controller in layers: HTTP service -> leader duties and forwarding -> Raft node ->
  replicated state -> its pure model -> placement;
- every module of every package in a layer of a layered contract (issue 41,
  tests/core/test_folders.py);
- no import cycle among the modules of any package (`acyclic_siblings`, issue 26), and no
  module imports another module's private name.

Every import counts, lazy ones inside functions included. And no module of the parameter server
or of the controller reads another object's private members (`ps._wait`, `m._holder_live`):
they go through a public interface."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: packages whose modules talk to each other only through public names
PUBLIC_ONLY = ("adamps/server", "controller")


def test_the_import_contracts_hold() -> None:
    # lint-imports puts the working directory first on sys.path: this checkout, not an install.
    lint = Path(sys.executable).with_name("lint-imports")
    res = subprocess.run(
        [str(lint), "--no-cache", "--config", "pyproject.toml"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    assert "0 broken" in res.stdout, res.stdout


def private_reads(path: Path) -> list[str]:
    """`x._name` where x is not self or cls (dunders aside)."""
    bad = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
        ):
            bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: .{node.attr}")
    return bad


#: modules exempt, and why
EXEMPT = {
    # pysyncobj's TCP transport, subclassed: its private members are the interface it overrides
    # (pysyncobj's version is pinned in pyproject.toml for this reason)
    "controller/raft_transport.py",
    # pysyncobj's SyncObj and journal, subclassed for the same reason (issue 39: a node that
    # cannot write its journal stands aside)
    "controller/raft_journal.py",
    # its mixins (issue 36): entries riding the heartbeats, a follower's thinned answers
    "controller/raft_riding.py",
    "controller/raft_answers.py",
}


def test_no_module_reads_another_objects_private_members() -> None:
    bad = [
        b
        for d in PUBLIC_ONLY
        for p in sorted((ROOT / d).rglob("*.py"))
        if str(p.relative_to(ROOT)) not in EXEMPT
        for b in private_reads(p)
    ]
    assert not bad, "private members read from outside their object:\n" + "\n".join(bad)


def private_imports(path: Path) -> list[str]:
    """`from module import _name`: a private name taken from another module."""
    return [
        f"{path.relative_to(ROOT)}:{node.lineno}: {node.module}.{alias.name}"
        for node in ast.walk(ast.parse(path.read_text(), str(path)))
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
        if alias.name.startswith("_") and not alias.name.startswith("__")
    ]


def test_no_module_imports_a_private_name_of_another() -> None:
    """Issue 26: trainer/partition_follower.py imported a private mixin of trainer/partitioned.py
    (and the two imported each other: the contract `no-cycles` in pyproject.toml)."""
    bad = [
        b
        for pkg in ("adamps", "controller", "coordinator", "dataserver", "trainer")
        for p in sorted((ROOT / pkg).rglob("*.py"))
        for b in private_imports(p)
    ]
    assert not bad, "private names imported from other modules:\n" + "\n".join(bad)


#: the roles: they build on adamps, never the other way round
ROLES = ("controller", "coordinator", "dataserver", "trainer")


def test_adamps_imports_none_of_the_roles() -> None:
    """Issue 41: no cycle between packages, and none whitelisted. Every import counts, lazy ones
    inside functions included; the console script reaches the roles by module name (importlib)."""
    bad = []
    for p in sorted((ROOT / "adamps").rglob("*.py")):
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and not node.level
                else []
            )
            bad += [
                f"{p.relative_to(ROOT)}:{node.lineno}: {n}"
                for n in names
                if n.split(".")[0] in ROLES
            ]
    assert not bad, "adamps imports a role:\n" + "\n".join(bad)
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (roles,) = [c for c in contracts["contracts"] if c["id"] == "roles"]
    assert not roles.get("ignore_imports"), f"whitelisted: {roles['ignore_imports']}"
