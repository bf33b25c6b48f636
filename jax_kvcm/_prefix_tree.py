"""Block keys and the radix tree of committed (full) pages with reference counts.

A *block key* is ``H(parent_key || token ids as int32 little-endian || salt)`` with ``H`` SHA-256
by default; the root's key is ``b""``. A committed page is a :class:`BlockNode`: its key, its
parent, its token ids as bytes (checked on every hit, so equal keys never imply a page holding other
tokens), where it lives (``level`` and one slot per layer group) and how many sequences hold it.

NOTE: a sequence holding a node holds every ancestor of it (a sequence's committed pages are a
prefix chain). So an unreferenced node has only unreferenced descendants, and dropping a node
drops its whole subtree (nothing below it is reachable any more).

Unreferenced nodes are *cached*: they sit in one LRU per cache level (``OrderedDict``, oldest
first) and are the only eviction candidates. A node may lack the page of some layer group
(``slots[g] == NO_PAGE``: a sliding-window page released once no holder's window covered it);
:meth:`PrefixTree.cached_pages` counts the pages cached nodes do have, per level and layer group.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Callable, Iterator

import numpy as np

from jax_kvcm._types import CacheLevel

__all__ = ["NO_PAGE", "BlockNode", "PrefixTree", "block_key", "salt_bytes", "token_bytes"]

NO_PAGE = -1  # in a node's (or any [G, n] slot array's) entry: that layer group has no page

HashFn = Callable[[bytes], bytes]


def _sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def salt_bytes(salt: object) -> bytes:
    """``None`` -> b"", bytes as is, str as UTF-8, int as its decimal text (tagged)."""
    if salt is None:
        return b""
    if isinstance(salt, (bytes, bytearray)):
        return b"b" + bytes(salt)
    if isinstance(salt, str):
        return b"s" + salt.encode("utf-8")
    if isinstance(salt, int) and not isinstance(salt, bool):
        return b"i" + str(salt).encode()
    raise TypeError(f"salt must be None, bytes, str or int, got {type(salt).__name__}")


def token_bytes(tokens: np.ndarray) -> bytes:
    """A page's token ids as int32 little-endian bytes (what keys hash and nodes store)."""
    return np.ascontiguousarray(tokens, "<i4").tobytes()


def block_key(parent_key: bytes, tokens: np.ndarray | bytes, salt: bytes,
              hash_fn: HashFn = _sha256) -> bytes:
    """The chained key of one full page."""
    if not isinstance(tokens, bytes):
        tokens = token_bytes(tokens)
    return hash_fn(parent_key + tokens + salt)


class BlockNode:
    """One committed page. ``slots[g]`` is its slot of layer group ``g`` at ``level`` (or
    ``NO_PAGE``); ``need[g]``: how many holders' windows still cover it (sliding-window groups;
    the manager keeps it, ``None`` without such groups)."""

    __slots__ = ("key", "parent", "tokens", "level", "slots", "refcount", "children", "alive",
                 "need", "whole")

    def __init__(self, key: bytes, parent: BlockNode | None, tokens: bytes,
                 level: CacheLevel, slots: np.ndarray) -> None:
        self.key = key
        self.parent = parent
        self.tokens = tokens
        self.level = level
        self.slots = slots
        self.refcount = 0
        self.children: dict[bytes, BlockNode] = {}
        self.alive = True
        self.need: list[int] | None = None
        self.whole = True  # a page in every layer group (kept by PrefixTree.move / set_page)

    def __repr__(self) -> str:
        return (f"BlockNode({self.key[:4].hex()}, level={self.level.name}, "
                f"slots={self.slots.tolist()}, refcount={self.refcount})")


class PrefixTree:
    """Committed pages by block key; reference counts; per-level LRUs of cached pages."""

    def __init__(self, hash_fn: HashFn | None = None, num_groups: int = 1) -> None:
        self.hash_fn: HashFn = hash_fn or _sha256
        self.nodes: dict[bytes, BlockNode] = {}
        self.roots: dict[bytes, BlockNode] = {}
        # NOTE: lru[level] holds exactly the nodes at `level` with refcount 0, oldest first.
        # Their pages per layer group: _num_whole[level] (nodes with every page, the common
        # case, counted without numpy) + _partial[level, g].
        self.lru: list[OrderedDict[int, BlockNode]] = [OrderedDict() for _ in CacheLevel]
        self._num_whole = [0] * len(CacheLevel)
        self._partial = np.zeros((len(CacheLevel), num_groups), np.int64)
        #: ``watch(node, old_level, old_slots)`` after a node is inserted (old_level None), moved
        #: or removed (``node.alive`` False); None: nobody watches (an arena's slot index does).
        self.watch: Callable[[BlockNode, CacheLevel | None, np.ndarray | None], None] | None = None

    def cached_pages(self, level: CacheLevel) -> np.ndarray:
        """Pages of cached nodes at ``level`` per layer group (a new array)."""
        return self._partial[level] + self._num_whole[level]

    def _cache(self, node: BlockNode) -> None:
        self.lru[node.level][id(node)] = node
        if node.whole:
            self._num_whole[node.level] += 1
        else:
            self._partial[node.level] += node.slots >= 0

    def _uncache(self, node: BlockNode) -> None:
        del self.lru[node.level][id(node)]
        if node.whole:
            self._num_whole[node.level] -= 1
        else:
            self._partial[node.level] -= node.slots >= 0

    def __len__(self) -> int:
        return len(self.nodes)

    def key(self, parent_key: bytes, tokens: np.ndarray | bytes, salt: bytes) -> bytes:
        return block_key(parent_key, tokens, salt, self.hash_fn)

    def match(self, tokens: np.ndarray, salt: bytes, page_size: int,
              max_pages: int) -> list[BlockNode]:
        """The longest chain of committed nodes equal to the first full pages of ``tokens``.

        Every hit is checked: the node's parent is the previous node and its token ids are the
        page's token ids (a key collision is a miss)."""
        out: list[BlockNode] = []
        parent: BlockNode | None = None
        parent_key = b""
        for p in range(max_pages):
            page = token_bytes(tokens[p * page_size:(p + 1) * page_size])
            key = self.key(parent_key, page, salt)
            node = self.nodes.get(key)
            if node is None or node.parent is not parent or node.tokens != page:
                break
            out.append(node)
            parent, parent_key = node, key
        return out

    def insert(self, key: bytes, parent: BlockNode | None, tokens: bytes,
               level: CacheLevel, slots: np.ndarray) -> BlockNode | None:
        """A new node with refcount 1, or ``None`` when ``key`` is taken (a duplicate or a
        collision: the caller keeps its page private)."""
        if key in self.nodes:
            return None
        node = BlockNode(key, parent, tokens, level, slots)
        node.refcount = 1
        self.nodes[key] = node
        (parent.children if parent is not None else self.roots)[key] = node
        if self.watch is not None:
            self.watch(node, None, None)
        return node

    def incref(self, node: BlockNode) -> None:
        if node.refcount == 0:
            self._uncache(node)
        node.refcount += 1

    def decref(self, node: BlockNode) -> None:
        if node.refcount <= 0:
            raise RuntimeError(f"decref of unreferenced {node!r}")
        node.refcount -= 1
        if node.refcount == 0:
            self._cache(node)

    def move(self, node: BlockNode, level: CacheLevel, slots: np.ndarray) -> None:
        """Records a migration of ``node`` (``slots``: its pages at ``level``, or NO_PAGE)."""
        if node.refcount == 0:
            self._uncache(node)
        old_level, old_slots = node.level, node.slots
        node.level = level
        node.slots = slots
        node.whole = bool((slots >= 0).all())
        if node.refcount == 0:
            self._cache(node)
        if self.watch is not None:
            self.watch(node, old_level, old_slots)

    def set_page(self, node: BlockNode, group: int, slot: int) -> None:
        """Gives a referenced ``node`` another page of one layer group (or NO_PAGE), at its
        level (a released or a donated window page)."""
        if node.refcount == 0:
            raise RuntimeError(f"set_page of cached {node!r}")
        node.slots[group] = slot
        node.whole = bool((node.slots >= 0).all())

    def lru_nodes(self, level: CacheLevel, n: int,
                  groups: np.ndarray | None = None) -> list[BlockNode]:
        """Up to ``n`` least recently released cached nodes at ``level`` (with ``groups``, a
        bool ``[G]`` mask: only nodes having a page of one of those layer groups)."""
        out = []
        for node in self.lru[level].values():
            if len(out) >= n:
                break
            if groups is None or (groups & (node.slots >= 0)).any():
                out.append(node)
        return out

    def subtree(self, node: BlockNode) -> Iterator[BlockNode]:
        stack = [node]
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def remove_subtree(self, node: BlockNode) -> list[BlockNode]:
        """Removes ``node`` and its descendants (all unreferenced); returns them."""
        removed = list(self.subtree(node))
        for n in removed:
            if n.refcount != 0:
                raise RuntimeError(f"dropping referenced {n!r}")
        siblings = node.parent.children if node.parent is not None else self.roots
        del siblings[node.key]
        for n in removed:
            del self.nodes[n.key]
            self._uncache(n)
            n.alive = False
            if self.watch is not None:
                self.watch(n, n.level, n.slots)
        return removed
