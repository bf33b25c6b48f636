"""Every ```python block of the README runs as written (each in a fresh namespace, in a fresh
temporary working directory), on the CPU, in seconds. A block fenced ```python sketch is an
outline with placeholders (it names what the reader supplies) and is not run."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_python_blocks():
    assert len(BLOCKS) >= 2


# Blocks that are clients of the HTTP server: tests/server/test_server.py runs them against a server.
SERVER_URL = "http://127.0.0.1:8000"


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs(index, tmp_path, monkeypatch):
    if SERVER_URL in BLOCKS[index]:
        pytest.skip("an HTTP server client: tests/server/test_server.py runs it against a server")
    monkeypatch.chdir(tmp_path)
    code = compile(BLOCKS[index], f"README.md python block {index}", "exec")
    namespace: dict = {"__name__": f"readme_block_{index}"}
    exec(code, namespace)  # noqa: S102 - the README's own code
    manager = namespace.get("manager")
    if manager is not None:  # the manager block ends with a reused prefix
        assert namespace["again"].num_reused_tokens == 32
        manager.check_invariants()
        manager.storage.close()
    assert os.getcwd() == str(tmp_path)
