"""The manuals stay true: every relative link in README.md, docs/*.md, benchmarks/README.md and
tools/README.md resolves to a file of the repository (and a heading, for ``#anchor`` links);
every ``--flag`` they name for one of the repository's own command lines (``python -m
examples.llama.run``, ``benchmarks.<x>``, ``tools.<x>``, ``scripts/gpu_check.sh``, ...) exists
in that command's parser; and every ```python block of docs/*.md runs as written."""

from __future__ import annotations

import importlib
import os
import re
import sys
from pathlib import Path

import pytest

import jax_kvcm  # noqa: F401  (the installed package before the repo root goes on sys.path)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the repo root: examples/, benchmarks/, tools/

DOCS = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", ROOT / "tools" / "README.md",
        *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
# A command of this repository: its parser, as (module, function) or a shell script's path.
COMMANDS = {
    r"(?:python3? )?(?:-m )?examples[./]llama[./]run(?:\.py)?|jax-kvcm-run": ("examples.llama.run",),
    r"(?:python3? )?-m examples\.llama\.server|jax-kvcm-serve": ("examples.llama.server",),
    r"(?:python3? )?-m benchmarks\.(?:bench_)?serve(?![_\w])": ("benchmarks.harness.serve_cli",),
    r"(?:python3? )?-m benchmarks\.(bench_\w+|report)": ("benchmarks.{0}",),
    r"(?:python3? )?-m tools\.(\w+)": ("tools.{0}",),
    r"scripts/gpu_check\.sh": ("scripts/gpu_check.sh",),
    r"tools/gpu_ab\.sh": ("tools/gpu_ab.sh",),
}


def _slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    text = re.sub(r"[`*_\[\]()]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_slug(m) for m in re.findall(r"(?m)^#+ (.*)$", path.read_text())}


def _links():
    for doc in DOCS:
        for target in LINK.findall(doc.read_text()):
            if not re.match(r"[a-z]+:", target):          # http:, mailto: ...
                yield pytest.param(doc, target, id=f"{doc.relative_to(ROOT)}->{target}")


@pytest.mark.parametrize("doc,target", list(_links()))
def test_relative_link_resolves(doc, target):
    path, _, anchor = target.partition("#")
    dest = (doc.parent / path).resolve() if path else doc
    assert dest.exists(), f"{doc.relative_to(ROOT)}: {target} does not exist"
    assert ROOT in dest.parents or dest == ROOT, f"{target} leaves the repository"
    if anchor:
        assert dest.is_file() and anchor in _anchors(dest), f"{target}: no heading #{anchor}"


def _parser_flags(target: str) -> set[str]:
    """The flags a command accepts: its argparse parser's (``build_parser()``), or a shell
    script's ``case`` patterns (``--name)`` / ``--name=*)``)."""
    if target.endswith(".sh"):
        return set(re.findall(r"(?m)^\s*(--[a-z][a-z0-9-]*)(?:=\*)?\)", (ROOT / target).read_text()))
    parser = importlib.import_module(target).build_parser()
    return {s for a in parser._actions for s in a.option_strings}  # noqa: SLF001


def _code(text: str) -> list[str]:
    """The commands in code blocks (backslash continuations joined) and inline code spans."""
    blocks = re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S)
    lines = [ln for b in blocks for ln in b.replace("\\\n", " ").splitlines()]
    spans = re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    return lines + spans


def _named_flags():
    """(doc, command target, flag) for every flag written after one of COMMANDS."""
    for doc in DOCS:
        for code in _code(doc.read_text()):
            for pattern, (target,) in COMMANDS.items():
                for m in re.finditer(pattern, code):
                    rest = re.split(r"\s(?:#|&&|\||;|&)\s|\s&$", code[m.end():])[0]
                    name = target.format(*m.groups())
                    for flag in FLAG.findall(rest):
                        yield doc, name, flag


def _all_flags_cases():
    seen = set()
    for doc, target, flag in _named_flags():
        if (target, flag) not in seen:
            seen.add((target, flag))
            yield pytest.param(target, flag, id=f"{target} {flag}")


@pytest.mark.parametrize("target,flag", list(_all_flags_cases()))
def test_named_flag_exists(target, flag):
    assert flag in _parser_flags(target), f"{flag} is not a flag of {target}"


def test_the_flag_check_sees_the_manuals_commands():
    """The patterns above find the commands the manuals name (else the test checks nothing)."""
    targets = {t for _, t, _ in _named_flags()}
    assert {"examples.llama.run", "examples.llama.server", "benchmarks.harness.serve_cli",
            "benchmarks.bench_attention", "scripts/gpu_check.sh", "tools/gpu_ab.sh"} <= targets
    assert _parser_flags("scripts/gpu_check.sh") >= {"--only", "--dry-run", "--full-serve"}


def test_bare_flag_spans_belong_to_a_command():
    """A code span that is just a flag (``--hot-backend``) names one of the repository's
    commands' flags."""
    known = set().union(*(_parser_flags(t) for t in (
        "examples.llama.run", "examples.llama.server", "benchmarks.harness.serve_cli",
        "benchmarks.bench_attention", "benchmarks.bench_migration", "benchmarks.bench_arena_map",
        "benchmarks.bench_decode_step", "benchmarks.bench_mixed_step",
        "benchmarks.bench_manager_overhead",
        "benchmarks.bench_serve_http", "benchmarks.bench_soak_http", "benchmarks.report",
        "benchmarks.bench_handoff", "benchmarks.bench_speculate", "benchmarks.bench_cascade",
        "tools.prefill_ab", "tools.random_run",
        "tools.prefill_profile", "tools.sass_regions", "tools.kernel_gaps",
        "tools.sim_sm90_prefill_protocol", "tools.ptx_identity", "scripts/gpu_check.sh",
        "tools/gpu_ab.sh")))
    bad = []
    for doc in DOCS:
        for flag in re.findall(r"`(--[a-z][a-z0-9-]*)(?:[ =][^`\n]*)?`", doc.read_text()):
            if flag not in known:
                bad.append(f"{doc.relative_to(ROOT)}: {flag}")
    assert not bad, bad


BLOCKS = [(doc, i, b) for doc in sorted((ROOT / "docs").glob("*.md"))
          for i, b in enumerate(re.findall(r"```python\n(.*?)```", doc.read_text(), flags=re.S))]


@pytest.mark.parametrize("doc,index,block", BLOCKS,
                         ids=[f"{d.name}:{i}" for d, i, _ in BLOCKS])
def test_docs_python_block_runs(doc, index, block, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": f"docs_block_{doc.stem}_{index}"}
    exec(compile(block, f"{doc.name} python block {index}", "exec"), namespace)  # noqa: S102
    if "manager" in namespace:         # the manager manual's example leaves its tiers open
        namespace["manager"].shutdown()
    assert os.getcwd() == str(tmp_path)


@pytest.mark.parametrize("target,doc", [("examples.llama.run", "serving.md"),
                                        ("examples.llama.server", "serving.md"),
                                        ("benchmarks.harness.serve_cli", "benchmarks.md")])
def test_every_flag_of_the_main_commands_is_documented(target, doc):
    """The runner's, the server's and the serving benchmark's flags are all in their manual."""
    text = (ROOT / "docs" / doc).read_text()
    missing = sorted(f for f in _parser_flags(target) - {"-h", "--help"}
                     if not re.search(re.escape(f) + r"(?![\w-])", text))
    assert not missing, f"docs/{doc} does not name {missing}"
