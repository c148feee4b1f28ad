"""Every command a user can type first: `adamps --help` and `adamps SUB --help` for each
subcommand it lists, run as the installed console script (issue 26: a '%' in one field's help
text crashed `adamps train --help`)."""

import re
import shutil
import subprocess
import sys

import pytest

ADAMPS = shutil.which("adamps") or ""


def _run(*args: str) -> subprocess.CompletedProcess:
    cmd = [ADAMPS, *args] if ADAMPS else [sys.executable, "-m", "adamps.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def _subcommands() -> list[str]:
    out = _run("--help").stdout
    listing = out.split("commands:", 1)[1]
    return re.findall(r"^  ([a-z][a-z-]*)\b", listing, flags=re.M)


def test_top_level_help_lists_the_roles() -> None:
    subs = _subcommands()
    for role in ("up", "ps", "controller", "dataserver", "train", "status", "coordinator"):
        assert role in subs


@pytest.mark.parametrize("sub", _subcommands())
def test_every_subcommand_help_works(sub: str) -> None:
    proc = _run(sub, "--help")
    assert proc.returncode == 0, proc.stderr
    assert "usage:" in proc.stdout
    assert "Traceback" not in proc.stderr
