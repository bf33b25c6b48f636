"""``--xla-option KEY=VALUE[,KEY=VALUE...]``: XLA compiler options from the command line, for
``jax.jit(..., compiler_options=...)`` (``bench_decode_step`` variants, ``serve.py``'s step)."""

from __future__ import annotations


def _xla_option(text: str) -> tuple[str, bool | int | str]:
    """``"KEY=VALUE"`` -> ``(KEY, VALUE)`` with true/false as bools and digits as ints."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise SystemExit(f"--xla-option {text!r}: expected KEY=VALUE")
    low = value.lower()
    if low in ("true", "false"):
        return key, low == "true"
    return key, int(value) if value.lstrip("-").isdigit() else value


def xla_options(text: str) -> tuple[tuple[str, bool | int | str], ...]:
    """One ``--xla-option``: ``"KEY=VALUE[,KEY=VALUE...]"`` -> ``((KEY, VALUE), ...)``, the
    compiler options of one compiled variant (hashable: ``ServeConfig.xla_options``)."""
    return tuple(_xla_option(part) for part in text.split(","))
