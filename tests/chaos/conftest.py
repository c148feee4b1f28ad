"""The chaos tests import their nemesis as `tests.chaos.nemesis`: the repository root must be on
sys.path also when pytest is started as `pytest` rather than `python -m pytest`."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
