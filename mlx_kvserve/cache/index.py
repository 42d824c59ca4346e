"""Token radix trie: longest-common-prefix lookup over every entry, RAM and disk alike.

A plain per-token trie costs one dict per token (gigabytes for a few hundred 30k-token
prompts); here each edge holds a run of tokens as a numpy slice, so memory is proportional to the
distinct tokens stored and a lookup costs a handful of vectorised compares.

Each node also caches the shallowest *trimmable* entry in its subtree. A trimmable (delta)
entry serves any prefix of its tokens, so once the walk knows how far the prompt agrees with
some trimmable entry it can pick the cheapest entry that covers that far in O(1).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two 1-D integer arrays."""
    m = min(a.shape[0], b.shape[0])
    if m == 0:
        return 0
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if diff.size else m


class _Node:
    __slots__ = ("edge", "children", "parent", "depth", "key", "trimmable", "min_trim")

    def __init__(self, edge: np.ndarray, parent: _Node | None, depth: int) -> None:
        self.edge = edge  # tokens on the edge from the parent to this node
        self.children: dict[int, _Node] = {}
        self.parent = parent
        self.depth = depth  # tokens from the root to the end of this node's edge
        self.key: str | None = None  # entry ending exactly here
        self.trimmable = False
        self.min_trim: tuple[int, str] | None = None  # (depth, key) shallowest trimmable below

    @property
    def start(self) -> int:
        return self.depth - self.edge.shape[0]

    def recompute(self) -> None:
        best = (self.depth, self.key) if (self.key is not None and self.trimmable) else None
        for child in self.children.values():
            if child.min_trim is not None and (best is None or child.min_trim < best):
                best = child.min_trim
        self.min_trim = best


@dataclass(frozen=True)
class Walk:
    """Where a prompt leaves the trie.

    `trim_lcp`: longest common prefix with any trimmable entry; `trim_key`: the shallowest
    trimmable entry that shares at least `limit`-capped `trim_lcp` tokens (see `TokenIndex.walk`);
    `prefixes`: (length, key) of every entry whose tokens are a prefix of the prompt, shortest
    first.
    """

    trim_lcp: int
    trim_key: str | None
    trim_key_len: int
    prefixes: list[tuple[int, str]]


class TokenIndex:
    """Maps token sequences to entry keys; answers prefix and common-prefix queries."""

    def __init__(self) -> None:
        self._root = _Node(np.zeros(0, dtype=np.uint32), None, 0)
        self._count = 0

    def __len__(self) -> int:
        return self._count

    # -- mutation -----------------------------------------------------------------------------
    def insert(self, tokens: np.ndarray, key: str, trimmable: bool) -> str | None:
        """Add `key` at `tokens`; returns the key previously stored there, if any."""
        node = self._root
        pos = 0
        n = tokens.shape[0]
        while pos < n:
            tok = int(tokens[pos])
            child = node.children.get(tok)
            if child is None:
                leaf = _Node(tokens[pos:], node, n)
                node.children[tok] = leaf
                node = leaf
                pos = n
                break
            m = common_prefix(child.edge, tokens[pos:])
            if m < child.edge.shape[0]:
                child = self._split(child, m)
            node = child
            pos += m
        previous = node.key
        was_trimmable = node.trimmable
        node.key = key
        node.trimmable = trimmable
        if previous is None:
            self._count += 1
        if previous is not None and (was_trimmable or trimmable):
            self._fix_upwards(node)
        elif trimmable:
            # Adding a value can only lower minima: stop where it no longer does.
            value = (node.depth, key)
            cur: _Node | None = node
            while cur is not None and (cur.min_trim is None or value <= cur.min_trim):
                cur.min_trim = value
                cur = cur.parent
        return previous

    def remove(self, tokens: np.ndarray, key: str) -> bool:
        """Remove `key` stored at `tokens`; False if it is not there."""
        node = self._find(tokens)
        if node is None or node.key != key:
            return False
        node.key = None
        node.trimmable = False
        self._count -= 1
        # Drop empty leaves and merge pass-through nodes so the tree stays compact.
        while node is not self._root and node.key is None and not node.children:
            parent = node.parent
            assert parent is not None
            del parent.children[int(node.edge[0])]
            node = parent
        if node is not self._root and node.key is None and len(node.children) == 1:
            (child,) = node.children.values()
            parent = node.parent
            assert parent is not None
            child.edge = np.concatenate([node.edge, child.edge])
            child.parent = parent
            parent.children[int(node.edge[0])] = child
            node = parent
        self._fix_upwards(node)
        return True

    def clear(self) -> None:
        self.__init__()

    # -- queries ------------------------------------------------------------------------------
    def walk(self, tokens: np.ndarray, limit: int) -> Walk:
        """Follow `tokens` down the trie.

        The trimmable match is capped at `limit`: the returned `trim_key` is the shallowest
        trimmable entry whose tokens share at least min(trim_lcp, limit) tokens with the prompt.
        """
        node = self._root
        pos = 0
        n = tokens.shape[0]
        prefixes: list[tuple[int, str]] = []
        trim_lcp = 0
        cover: list[tuple[_Node, int]] = []  # (node, matched depth inside it) with trimmables
        while pos < n:
            child = node.children.get(int(tokens[pos]))
            if child is None:
                break
            m = common_prefix(child.edge, tokens[pos : pos + child.edge.shape[0]])
            if child.min_trim is not None:
                trim_lcp = pos + m
                cover.append((child, pos + m))
            if m < child.edge.shape[0]:
                break
            node = child
            pos += m
            if node.key is not None:
                prefixes.append((node.depth, node.key))
        usable = min(trim_lcp, limit)
        trim_key = None
        trim_len = 0
        if usable > 0:
            # The node whose edge contains position `usable`: every entry below it shares the
            # first `usable` prompt tokens.
            for cnode, _ in cover:
                if cnode.start < usable <= cnode.depth:
                    assert cnode.min_trim is not None
                    trim_len, trim_key = cnode.min_trim
                    break
        return Walk(trim_lcp, trim_key, trim_len, prefixes)

    def prefix_entries(self, tokens: np.ndarray) -> list[tuple[int, str]]:
        """(length, key) of entries whose tokens are a prefix of `tokens` (inclusive)."""
        return self.walk(tokens, 0).prefixes

    def longest_prefix(
        self, tokens: np.ndarray, accept: Callable[[str], bool], *, strict: bool = True
    ) -> tuple[int, str] | None:
        """Deepest accepted entry whose tokens are a (strict) prefix of `tokens`."""
        n = tokens.shape[0]
        for length, key in reversed(self.prefix_entries(tokens)):
            if strict and length >= n:
                continue
            if accept(key):
                return length, key
        return None

    def keys(self) -> Iterator[str]:
        stack = [self._root]
        while stack:
            node = stack.pop()
            if node.key is not None:
                yield node.key
            stack.extend(node.children.values())

    def node_count(self) -> int:
        count = 0
        stack = [self._root]
        while stack:
            node = stack.pop()
            count += 1
            stack.extend(node.children.values())
        return count

    # -- internals ----------------------------------------------------------------------------
    def _find(self, tokens: np.ndarray) -> _Node | None:
        node = self._root
        pos = 0
        n = tokens.shape[0]
        while pos < n:
            child = node.children.get(int(tokens[pos]))
            if child is None:
                return None
            length = child.edge.shape[0]
            if pos + length > n or common_prefix(child.edge, tokens[pos : pos + length]) < length:
                return None
            node = child
            pos += length
        return node

    def _split(self, child: _Node, m: int) -> _Node:
        """Insert a node after the first `m` tokens of `child`'s edge; return it."""
        parent = child.parent
        assert parent is not None
        mid = _Node(child.edge[:m], parent, child.start + m)
        parent.children[int(child.edge[0])] = mid
        child.edge = child.edge[m:]
        child.parent = mid
        mid.children[int(child.edge[0])] = child
        mid.recompute()
        return mid

    def _fix_upwards(self, node: _Node | None) -> None:
        """Recompute minima from `node` up, stopping once one is unchanged."""
        while node is not None:
            before = node.min_trim
            node.recompute()
            if node.min_trim == before:
                return
            node = node.parent
