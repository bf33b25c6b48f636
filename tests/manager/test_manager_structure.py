"""The rules of ``jax_kvcm.manager``'s package docstring, checked on the source (no import):
nothing imports the facade, collaborators never reach into another object's ``_fields`` (the
``Sequence`` record's slots excepted), no library file is over 600 lines."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2] / "jax_kvcm"
MANAGER = ROOT / "manager"
# The Sequence handle's bookkeeping slots: the manager's shared record (api.Sequence).
SEQUENCE_SLOTS = {"_row", "_nodes", "_parked", "_done_step", "_salt", "_rows"}


def _sources(folder: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in folder.rglob("*.py"))


def _private_reaches(tree: ast.AST) -> list[tuple[int, str]]:
    """``(line, expr)`` of every ``<object>._name`` whose object is not ``self`` / ``cls``."""
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        attr = node.attr
        if not attr.startswith("_") or attr.startswith("__") or attr in SEQUENCE_SLOTS:
            continue
        base = node.value
        if isinstance(base, ast.Name) and base.id in ("self", "cls"):
            continue
        out.append((node.lineno, ast.unparse(node)))
    return out


def test_nothing_imports_the_facade():
    offenders = []
    for path in _sources(ROOT):
        if path == MANAGER / "__init__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "jax_kvcm.manager.facade":
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, f"the facade is imported by {offenders}"


@pytest.mark.parametrize("path", _sources(MANAGER), ids=lambda p: p.name)
def test_collaborators_keep_to_their_own_fields(path):
    reaches = _private_reaches(ast.parse(path.read_text()))
    assert not reaches, f"{path.name} touches another object's private fields: {reaches}"


def test_the_checker_sees_a_private_reach():
    """The checker itself: a reach into another object's field is found, self's is not."""
    src = "def f(self, other):\n    self._mine = other._theirs + seq._row\n"
    assert _private_reaches(ast.parse(src)) == [(2, "other._theirs")]


@pytest.mark.parametrize("path", _sources(ROOT), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_library_file_over_600_lines(path):
    n = len(path.read_text().splitlines())
    assert n <= 600, f"{path.relative_to(ROOT)} has {n} lines"
