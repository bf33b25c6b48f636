"""The repository is self-contained: it carries its own architecture document, the README links
it, and no file names a file outside the repository (a path into a sibling ``shared`` folder, a
design-seed file name) -- a fresh clone has neither."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUTSIDE = re.compile(r"\.\./" + "shared|\\b[0-9]{3}_[0-9a-f]{16}\\b")
SKIP_DIRS = {".git", "build", ".venv", "__pycache__", ".pytest_cache", ".hypothesis", "dist"}
TEXT = {".py", ".pyi", ".md", ".txt", ".toml", ".cc", ".cu", ".cuh", ".h", ".sh", ".cfg", ".json",
        ".yaml", ".yml", ""}


def repo_files():
    for path in ROOT.rglob("*"):
        rel = path.relative_to(ROOT)
        if any(part in SKIP_DIRS or part.endswith(".egg-info") for part in rel.parts):
            continue
        if path.is_file() and path.suffix in TEXT:
            yield rel, path


def test_no_file_names_a_file_outside_the_repository():
    bad = []
    for rel, path in repo_files():
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        for n, line in enumerate(text.splitlines(), 1):
            if OUTSIDE.search(line):
                bad.append(f"{rel}:{n}: {line.strip()[:100]}")
    assert not bad, "\n".join(bad)


def test_architecture_document_is_in_the_repository_and_linked():
    doc = ROOT / "docs" / "ARCHITECTURE.md"
    assert doc.is_file()
    assert "docs/ARCHITECTURE.md" in (ROOT / "README.md").read_text()
