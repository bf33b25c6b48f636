"""The tests' group folders (``ops/``, ``manager/``, ...) on ``sys.path``, so a test, a worker
script or ``tools/random_run.py`` imports another group's helpers by module name
(``from test_manager import Harness``, ``import faults``)."""

from __future__ import annotations

import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def add_to_sys_path() -> None:
    for path in [TESTS, *sorted(p for p in TESTS.iterdir()
                                if p.is_dir() and not p.name.startswith((".", "_")))]:
        if str(path) not in sys.path:
            sys.path.append(str(path))
