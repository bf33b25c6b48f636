"""Moved to :mod:`jax_kvcm._arena_pool` (the transitional CPU arena imports it from here)."""

from jax_kvcm._arena_pool import ArenaPool  # noqa: F401
