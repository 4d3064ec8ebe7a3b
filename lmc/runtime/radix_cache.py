"""RadixCache: a radix tree over token sequences whose nodes own the KV slots of their edge (RadixAttention).

Invariants (checked by `check()` in tests):
- Every non-root node has a non-empty key and `len(value) == len(key)`; children are keyed by their first token.
- `lock_ref` of a node counts the requests whose locked path passes through it; the root is always locked.
- A token is *protected* when its node has lock_ref > 0, *evictable* otherwise; the two sizes are maintained
  incrementally and together equal the number of slots the tree owns.
- `_leaves` holds exactly the unlocked childless non-root nodes: the eviction candidates.
Eviction pops the least recently used leaf, frees its slots and cascades to the parent when that becomes an
unlocked leaf, so an interior prefix lives as long as anything below it. A caller may pass an eviction key that
ranks leaves before recency (the scheduler's retention by the program plan reads `Node.retain`, a tag it sets;
the tree only stores it, and a split leaves it on the lower part, which keeps the edge's end).
"""
from __future__ import annotations

import heapq
import itertools
from typing import Sequence

import torch

_EMPTY = torch.empty(0, dtype=torch.int64)


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two tuples, by C-level slice compares (galloping, then bisection)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # invariant: a[:lo] == b[:lo] and a[:hi] != b[:hi]
    step = 16
    while lo + step < hi and a[lo:lo + step] == b[lo:lo + step]:
        lo, step = lo + step, step * 2
    hi = min(hi, lo + step)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


_node_ids = itertools.count()


class Node:
    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access", "id", "retain")

    def __init__(self, key: tuple = (), value: torch.Tensor = _EMPTY, parent: "Node | None" = None):
        self.children: dict[int, Node] = {}
        self.parent = parent
        self.key = key
        self.value = value
        self.lock_ref = 0
        self.last_access = 0
        self.id = next(_node_ids)  # tie-break: eviction order must not depend on memory addresses
        self.retain = None  # the caller's retention tag (see the module docstring)

    def __lt__(self, other: "Node") -> bool:
        return (self.last_access, self.id) < (other.last_access, other.id)


class RadixCache:
    """Prefix cache over KV slots. `free_slots` is called with the slots of evicted nodes."""

    def __init__(self, free_slots=None, disabled: bool = False):
        self.free_slots = free_slots or (lambda slots: None)
        self.disabled = disabled
        self._clock = itertools.count(1)
        self.reset()

    def reset(self) -> None:
        self.root = Node()
        self.root.lock_ref = 1
        self.version = getattr(self, "version", 0) + 1  # bumped whenever a match result could change
        self.evictable_size = 0
        self.protected_size = 0
        self._leaves: set[Node] = set()

    @property
    def total_size(self) -> int:
        return self.evictable_size + self.protected_size

    # ---- queries -------------------------------------------------------------------------------------------
    def match(self, key: Sequence[int]) -> tuple[torch.Tensor, Node]:
        """Longest cached prefix of `key`: its slots and the node that ends exactly there (splitting an edge
        if the match ends inside it). Refreshes the LRU time of the path."""
        if self.disabled or not key:
            return _EMPTY, self.root
        path, _, _ = self._descend(tuple(key))
        return (torch.cat([n.value for n in path]) if path else _EMPTY), (path[-1] if path else self.root)

    def peek(self, key: Sequence[int]) -> torch.Tensor:
        """Slots of the longest cached prefix, without splitting or touching anything (for checks)."""
        values = [node.value[:n] for node, n in self._matched(tuple(key))]
        return torch.cat(values) if values else _EMPTY

    def prefix_len(self, key: Sequence[int]) -> int:
        """len(peek(key)), without gathering the slots."""
        return sum(n for _, n in self._matched(tuple(key)))

    def _matched(self, key: tuple):
        """The nodes along key's longest cached prefix, each with how many of its tokens match (all but perhaps
        the last's), touching nothing."""
        node, pos = self.root, 0
        while pos < len(key) and key[pos] in node.children:
            node = node.children[key[pos]]
            n = common_prefix_len(node.key, key[pos:pos + len(node.key)])
            yield node, n
            pos += n
            if n < len(node.key):
                return

    def _descend(self, key: tuple) -> tuple[list[Node], int, int]:
        """Walk key's longest cached prefix, splitting the edge where it ends inside one, so that it ends at a
        node, and refreshing the path's LRU time: (the path's nodes, root excluded; the tokens matched; the time)."""
        node, pos, path, now = self.root, 0, [], next(self._clock)
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                break
            n = common_prefix_len(child.key, key[pos:pos + len(child.key)])
            if n < len(child.key):
                child = self._split(child, n)  # the part below the match keeps its old access time
            child.last_access = now
            path.append(child)
            node, pos = child, pos + n
        return path, pos, now

    def insert(self, key: Sequence[int], value: torch.Tensor) -> int:
        """Insert key -> slots. Returns how many leading tokens were already cached: the caller owns (and must
        free) its own slots for those positions, since the tree keeps its existing copy."""
        if self.disabled or not key:
            return 0
        key = tuple(key)
        path, pos, now = self._descend(key)
        node = path[-1] if path else self.root
        if pos < len(key):
            leaf = Node(key[pos:], value[pos:].clone(), parent=node)
            leaf.last_access = now
            self._leaves.discard(node)
            node.children[key[pos]] = leaf
            self.evictable_size += len(leaf.key)
            self._leaves.add(leaf)
            self.version += 1
        return pos

    # ---- locking -------------------------------------------------------------------------------------------
    def lock(self, node: Node) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self.evictable_size -= len(node.key)
                self.protected_size += len(node.key)
                self._leaves.discard(node)
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node is not self.root:
            assert node.lock_ref > 0, "unlock of an unlocked node"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self.evictable_size += len(node.key)
                self.protected_size -= len(node.key)
                if not node.children:
                    self._leaves.add(node)
            node = node.parent

    # ---- eviction ------------------------------------------------------------------------------------------
    def evict(self, num_tokens: int, key=None) -> int:
        """Free at least `num_tokens` slots if possible, least recently used leaves first; with `key` (node ->
        sortable), smallest key first and least recently used among equals. Returns slots freed."""
        rank = (lambda n: (key(n), n)) if key is not None else (lambda n: ((), n))
        heap = [rank(n) for n in self._leaves]
        heapq.heapify(heap)
        freed = 0
        self.version += bool(heap)
        while freed < num_tokens and heap:
            _, leaf = heapq.heappop(heap)
            self.free_slots(leaf.value)
            freed += len(leaf.key)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            self._leaves.discard(leaf)
            self.evictable_size -= len(leaf.key)
            if parent is not self.root and parent.lock_ref == 0 and not parent.children:
                self._leaves.add(parent)
                heapq.heappush(heap, rank(parent))
        return freed

    # ---- internals -----------------------------------------------------------------------------------------
    def _split(self, child: Node, n: int) -> Node:
        """Cut `child`'s edge after n tokens; returns the new upper node, which inherits the lock count."""
        mid = Node(child.key[:n], child.value[:n].clone(), parent=child.parent)
        mid.lock_ref, mid.last_access = child.lock_ref, child.last_access
        child.parent.children[child.key[0]] = mid
        child.key, child.value, child.parent = child.key[n:], child.value[n:].clone(), mid
        mid.children[child.key[0]] = child
        return mid

    def nodes(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def check(self) -> None:
        """Recompute every invariant from scratch (tests call this after each step)."""
        evictable = protected = 0
        leaves = set()
        for node in self.nodes():
            if node is self.root:
                assert node.lock_ref >= 1
                continue
            assert node.key and len(node.value) == len(node.key), "key/value length mismatch"
            assert node.parent.children[node.key[0]] is node, "child keyed by a wrong token"
            assert node.lock_ref >= 0
            child_refs = sum(c.lock_ref for c in node.children.values())
            assert node.lock_ref >= child_refs, "children hold more locks than their parent"
            if node.lock_ref:
                protected += len(node.key)
            else:
                evictable += len(node.key)
                if not node.children:
                    leaves.add(node)
        assert (evictable, protected) == (self.evictable_size, self.protected_size), "size counters drifted"
        assert leaves == self._leaves, "evictable-leaf set drifted"

    def slots(self) -> torch.Tensor:
        """All slots the tree owns (tests use this for the accounting invariant)."""
        vals = [n.value for n in self.nodes() if n is not self.root]
        return torch.cat(vals) if vals else _EMPTY
