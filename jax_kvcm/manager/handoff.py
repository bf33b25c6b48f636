"""K/V handed between managers (disaggregated prefill): a sequence exported as bytes by one
manager and imported by another, in another process, as a sequence that decodes at once and
whose full pages the importer's prefix cache reuses.

- :class:`SequenceExport`: the token ids, the page size and layout, the salt, a model id the
  caller chose, and per layer group the pages as cold-page bytes ``uint8 [n, bytes]`` (the
  codec's host format, the same from paged and arena pools) with a CRC-32 per page.
  :meth:`SequenceExport.header` is its JSON-able part; :meth:`SequenceExport.from_parts` puts a
  header and the pages back together (a transport moves the pages,
  :mod:`jax_kvcm.handoff`).
- Export copies the device pages through the host tier (nothing moves); import checks the
  model id, page size, layout, codec, shapes and every checksum before it changes anything
  (ValueError naming the mismatch), then allocates device pages (None when there is no room:
  nothing changed), decodes the bytes into them and commits the full pages (pages the importer
  already holds are adopted, its own copies freed).
- Not handled: sliding-window groups (their pages leave the window; refused), sequences whose
  ids are not all known (refused: the importer hashes pages by their tokens).
"""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any

import numpy as np

from jax_kvcm._prefix_tree import PrefixTree
from jax_kvcm._types import CacheLevel
from jax_kvcm.manager.api import Sequence
from jax_kvcm.manager.committer import Committer
from jax_kvcm.manager.planner import TierPlanner
from jax_kvcm.manager.rows import RowTable, check_token_ids

__all__ = ["Handoff", "SequenceExport"]


def page_checksums(pages: np.ndarray) -> np.ndarray:
    """CRC-32 of each page ``pages [n, bytes]`` (uint32 ``[n]``)."""
    return np.fromiter((zlib.crc32(p.tobytes()) for p in pages), np.uint32, pages.shape[0])


@dataclasses.dataclass(frozen=True)
class SequenceExport:
    """A sequence's K/V and what an importer checks (see the module docstring)."""

    model_id: str
    token_ids: np.ndarray            # int32 [num_tokens]
    tokens_per_page: int
    layout: tuple[tuple, ...]        # per layer group, see Handoff.layout
    salt: bytes
    pages: tuple[np.ndarray, ...]    # per layer group: uint8 [num_pages, cold page bytes]
    checksums: tuple[np.ndarray, ...]  # per layer group: uint32 [num_pages]

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.size)

    def header(self) -> dict[str, Any]:
        """Everything but the page bytes, JSON-able."""
        return {"model_id": self.model_id, "token_ids": self.token_ids.tolist(),
                "tokens_per_page": self.tokens_per_page,
                "layout": [list(g) for g in self.layout], "salt": self.salt.hex(),
                "page_shapes": [list(p.shape) for p in self.pages],
                "checksums": [c.tolist() for c in self.checksums]}

    @classmethod
    def from_parts(cls, header: dict[str, Any], pages: list[Any]) -> SequenceExport:
        """A :meth:`header` and the pages (arrays of its ``page_shapes``) as one export."""
        return cls(model_id=str(header["model_id"]),
                   token_ids=np.asarray(header["token_ids"], np.int32),
                   tokens_per_page=int(header["tokens_per_page"]),
                   layout=tuple(tuple(g) for g in header["layout"]),
                   salt=bytes.fromhex(header["salt"]),
                   pages=tuple(np.asarray(p, np.uint8) for p in pages),
                   checksums=tuple(np.asarray(c, np.uint32) for c in header["checksums"]))


class Handoff:
    """Export and import of sequences (see the module docstring)."""

    def __init__(self, config: Any, storage: Any, tree: PrefixTree, rows: RowTable,
                 planner: TierPlanner, committer: Committer, arena_room: Any = None) -> None:
        self._config = config
        self._storage = storage
        self._tree = tree
        self._rows = rows
        self._planner = planner
        self._committer = committer
        self._arena = arena_room

    def layout(self) -> tuple[tuple, ...]:
        """Per layer group: ``(num_layers, num_kv_heads, head_dim, dtype, pool dtype,
        codec, cold page bytes)``."""
        codec = type(self._storage.codec).__name__
        return tuple((g.num_layers, g.num_kv_heads, g.head_dim, np.dtype(g.dtype).name,
                      np.dtype(g.pool_dtype).name, codec, int(self._storage.cold_page_bytes[i]))
                     for i, g in enumerate(self._config.layer_groups))

    def _check_layer_groups(self) -> None:
        windows = [i for i, g in enumerate(self._config.layer_groups) if g.sliding_window]
        if windows:
            raise ValueError(f"layer groups {windows} have sliding windows: their pages leave "
                             "the window, so sequences are not exported or imported")

    def export(self, seq: Sequence, model_id: str) -> SequenceExport:
        self._check_layer_groups()
        rows, r = self._rows, seq._row
        n = rows.num_tokens(r)
        if rows.num_known(r) < n:
            raise ValueError(f"seq: the ids of tokens {rows.num_known(r)}..{n - 1} are not known "
                             "(give ids to prepare_step, or record_token_ids)")
        table = rows.row_pages(r, 0, rows.num_pages(r))
        pages = tuple(self._storage.read_device_pages(g, table[g])
                      for g in range(rows.num_groups))
        return SequenceExport(model_id=str(model_id), token_ids=rows.tokens(r, 0, n).copy(),
                              tokens_per_page=rows.tpp, layout=self.layout(), salt=seq._salt,
                              pages=pages, checksums=tuple(page_checksums(p) for p in pages))

    def check(self, exp: SequenceExport, model_id: str) -> None:
        """ValueError naming the first thing ``exp`` disagrees on (nothing changes)."""
        self._check_layer_groups()
        if not isinstance(exp, SequenceExport):
            raise TypeError(f"export must be a SequenceExport, got {type(exp).__name__}")
        if exp.model_id != str(model_id):
            raise ValueError(f"model_id: the export is of {exp.model_id!r}, this manager serves "
                             f"{str(model_id)!r}")
        if exp.tokens_per_page != self._rows.tpp:
            raise ValueError(f"tokens_per_page: the export's is {exp.tokens_per_page}, this "
                             f"manager's {self._rows.tpp}")
        mine = self.layout()
        if len(exp.layout) != len(mine):
            raise ValueError(f"layout: the export has {len(exp.layout)} layer groups, this "
                             f"manager {len(mine)}")
        names = ("num_layers", "num_kv_heads", "head_dim", "dtype", "kv dtype", "codec",
                 "cold page bytes")
        for g, (theirs, ours) in enumerate(zip(exp.layout, mine)):
            for name, a, b in zip(names, theirs, ours):
                if a != b:
                    raise ValueError(f"layout: layer group {g} {name} is {a!r} in the export, "
                                     f"{b!r} here")
        n = exp.num_tokens
        if not 0 < n <= self._config.max_seq_len:
            raise ValueError(f"token_ids: {n} tokens, expected 1..{self._config.max_seq_len}")
        check_token_ids(exp.token_ids, "token_ids")
        pages = -(-n // self._rows.tpp)
        for g, (p, c) in enumerate(zip(exp.pages, exp.checksums)):
            want = (pages, mine[g][-1])
            if p.shape != want or c.shape != (pages,):
                raise ValueError(f"pages: layer group {g} holds {p.shape} bytes and "
                                 f"{c.shape} checksums, expected {want}")
            bad = np.flatnonzero(page_checksums(p) != c)
            if bad.size:
                raise ValueError(f"checksums: layer group {g} pages {bad.tolist()} do not match "
                                 "their checksum (corrupted in transit)")

    def import_(self, exp: SequenceExport, model_id: str) -> Sequence | None:
        self.check(exp, model_id)
        rows, cfg = self._rows, self._config
        n = exp.num_tokens
        pages = -(-n // rows.tpp)
        seq = rows.open(exp.token_ids, exp.salt, [], cfg.enable_prefix_reuse)
        slots = None
        try:
            at = None
            if self._arena is not None:
                if not self._arena.bind(seq, []):
                    rows.release(seq)
                    return None
                at = self._arena.place(seq, np.arange(pages))
            slots = self._planner.allocate_device(pages, at)
            if slots is None:
                self._undo(seq, None)
                return None
            for g in range(rows.num_groups):
                self._storage.write_device_pages(g, exp.pages[g], slots[g])
        except BaseException:
            self._undo(seq, slots)
            raise
        rows.restore(seq._row, pages, n, n)
        rows.write_row(seq, slots)
        rows.mark_ran(np.array([seq._row]))
        if cfg.enable_prefix_reuse:
            self._committer.commit([seq], np.array([seq._row], np.int64))
        return seq

    def _undo(self, seq: Sequence, slots: np.ndarray | None) -> None:
        if slots is not None:
            for g in range(slots.shape[0]):
                self._storage.free(CacheLevel.DEVICE, g, slots[g])
        if self._arena is not None:
            self._arena.unbind(seq)
        self._rows.release(seq)
