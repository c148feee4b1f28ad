"""What a user runs gets the documented default timeouts (issue 39, finding 4): `adamps up`,
the examples and the trainers' `--local` clusters start their controllers and servers without
the fault tests' short ones (adamps.up.cluster.FAST_*: a server declared dead after 1 s of
silence), which a loaded machine turns into servers declared dead by the dozen (the testers'
tool saw 78 in 10 minutes). The tests keep the short ones through their own fixtures."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: what a user starts: the console script's local cluster, the examples, the trainers
USER_ENTRIES = [
    ROOT / "adamps" / "up" / "main.py",
    *sorted((ROOT / "examples").glob("*.py")),
    *sorted((ROOT / "trainer").glob("*.py")),
    *sorted((ROOT / "coordinator").glob("*.py")),
]
#: the tests' timings, and the flags that would set their like
FAST = {"FAST_CONTROLLER_OPTS", "FAST_PS_OPTS", "FAST_LEASE"}
FLAGS = {"server-timeout", "lease-duration", "heartbeat-interval", "member-timeout",
         "failover-after", "election-min", "election-max"}  # fmt: skip


def test_user_entry_points_use_the_documented_default_timeouts() -> None:
    assert len(USER_ENTRIES) > 5 and all(p.exists() for p in USER_ENTRIES)
    found = []
    for path in USER_ENTRIES:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            name = node.id if isinstance(node, ast.Name) else getattr(node, "attr", None)
            if isinstance(node, ast.alias):
                name = node.name
            if name in FAST:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {name}")
            if isinstance(node, ast.Constant) and node.value in FLAGS:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value!r}")
    assert not found, f"the tests' timeouts where a user starts a cluster: {found}"
