"""No library file over 600 lines (the rule in jax_kvcm/manager/__init__.py, for the Python package
and for the C++ / CUDA sources under ffi/). The files still over it are listed with their size
today as a ceiling, so they can only shrink until they are split."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MOST_LINES = 600
# Files still over the rule, with their size today as a ceiling (none).
CEILINGS: dict[str, int] = {}


def _library_files():
    yield from (ROOT / "jax_kvcm").rglob("*.py")
    for pattern in ("*.cc", "*.cu", "*.cuh", "*.h"):
        yield from (ROOT / "ffi").rglob(pattern)


def test_no_library_file_is_over_600_lines():
    over = {}
    for path in _library_files():
        name = path.relative_to(ROOT).as_posix()
        lines = len(path.read_text().splitlines())
        if lines > CEILINGS.get(name, MOST_LINES):
            over[name] = lines
    assert not over, f"over {MOST_LINES} lines (or over their ceiling): {over}"


def test_the_ceilings_name_files_that_exist_and_are_still_over():
    for name, ceiling in CEILINGS.items():
        lines = len((ROOT / name).read_text().splitlines())
        assert MOST_LINES < lines <= ceiling, (name, lines)
