"""The replication core is changed only through its inputs (issue 40): no module but the core's
own writes an attribute of a ``ReplCore``, nor changes a container it holds (its roles, copies,
persisted cuts, ...). A write from outside bypasses the core's decisions and the Ready that
reports them, and a simulation that feeds the inputs would never run it.

The scan reads every shipped module (tests are left out: they build states directly) and
finds, on an expression that names a core (``core``, ``x.core``, or a name annotated or
assigned ``ReplCore``):

- an assignment, augmented assignment or ``del`` of anything under it (``core.a = ...``,
  ``core.a[b] = ...``, ``del core.a[b]``, ``rep.core.a.b += 1``);
- a container mutator taken from anything under it, called or passed on
  (``core.a.pop(b)``, ``loop.call_soon(rep.core.a.pop, b)``);
- ``setattr``/``delattr`` on it.

The core's own modules (those defining ``ReplCore`` and the classes it is made of) are exempt.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from adamps.core.replication.node import ReplCore

ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ("adamps", "controller", "coordinator", "dataserver", "trainer", "benchmarks", "examples")
MUTATORS = frozenset(
    {"pop", "popitem", "clear", "update", "setdefault", "append", "extend", "insert", "remove",
     "discard", "add", "sort", "reverse", "__setitem__", "__delitem__", "__setattr__"}
)  # fmt: skip


def core_modules() -> set[Path]:
    """The files of ReplCore and of every class it is made of (its bases)."""
    out = set()
    for cls in ReplCore.__mro__:
        if cls.__module__.startswith("adamps.core."):
            out.add(Path(inspect.getfile(cls)).resolve())
    return out


def _core_names(tree: ast.AST) -> set[str]:
    """Names bound to a ReplCore in a module: `core`, and those annotated or assigned one."""
    names = {"core"}
    for node in ast.walk(tree):
        if isinstance(node, (ast.arg, ast.AnnAssign)) and node.annotation is not None:
            target = node.arg if isinstance(node, ast.arg) else node.target
            if "ReplCore" in ast.unparse(node.annotation) and isinstance(target, (str, ast.Name)):
                names.add(target if isinstance(target, str) else target.id)
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            if ast.unparse(node.value.func).endswith("ReplCore"):
                names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def _is_core(node: ast.AST, names: set[str]) -> bool:
    if isinstance(node, ast.Name):
        return node.id in names
    return isinstance(node, ast.Attribute) and node.attr == "core"


def _under_core(node: ast.AST, names: set[str]) -> bool:
    """`node` is an attribute or item reached from a core (not the core itself)."""
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        node = node.value
        if _is_core(node, names):
            return True
    return False


def writes(source: str) -> list[tuple[int, str]]:
    """(line, code) of every write to a ReplCore's state in `source`."""
    tree = ast.parse(source)
    names = _core_names(tree)
    found = []

    def hit(node: ast.AST) -> None:
        found.append((node.lineno, ast.unparse(node)))  # type: ignore[attr-defined]

    for node in ast.walk(tree):
        targets: list[ast.AST] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = list(node.targets)
        for t in targets:
            for sub in ast.walk(t):  # also tuple targets: (core.a, x) = ...
                if isinstance(sub, (ast.Attribute, ast.Subscript)) and _under_core(sub, names):
                    hit(node)
                    break
        if isinstance(node, ast.Attribute) and node.attr in MUTATORS:
            if _under_core(node.value, names) or _is_core(node.value, names):
                hit(node)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id in ("setattr", "delattr") and node.args:
                if _is_core(node.args[0], names) or _under_core(node.args[0], names):
                    hit(node)
    return found


def shipped_modules() -> list[Path]:
    exempt = core_modules()
    out = []
    for top in SHIPPED:
        for p in sorted((ROOT / top).rglob("*.py")):
            if p.resolve() not in exempt:
                out.append(p)
    return out


def test_no_module_outside_the_core_writes_its_state() -> None:
    modules = shipped_modules()
    assert len(modules) > 100, "the walk found too few modules: is ROOT the repository?"
    bad = {
        f"{p.relative_to(ROOT)}:{line}": code
        for p in modules
        for line, code in writes(p.read_text())
    }
    assert not bad, f"change the replication core through its inputs, not its attributes: {bad}"


def test_the_scan_finds_each_kind_of_write() -> None:
    """A guard against a scan that finds nothing: each shape of write is found, reads are not."""
    src = """
def f(core, rep, loop, other):
    core.persist_blocked = "x"
    core.persisted[3] = 1
    del core.persisted[3]
    rep.core.roles[1] += "y"
    loop.call_soon_threadsafe(rep.core.persisted.pop, 3, None)
    core.buckets[1].pending.clear()
    setattr(core, "table_version", 2)
    ok = core.buckets.get(1), core.roles.values(), core.tick(0.0), other.persisted.pop(1)
    rep.core = None
def g(c: ReplCore):
    c.roles[1] = "primary"
def h():
    mine = ReplCore(settings)
    mine.table_version = 1
"""
    lines = sorted(line for line, _code in writes(src))
    assert lines == [3, 4, 5, 6, 7, 8, 9, 13, 16], writes(src)


def test_the_core_modules_are_the_cores_own() -> None:
    names = {p.name for p in core_modules()}
    assert {"node.py", "controllers.py", "join.py", "disk.py"} <= names
    assert "copies.py" not in names, "the copies' views are scanned like any other module"
