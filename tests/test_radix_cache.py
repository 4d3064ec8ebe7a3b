"""Property and unit tests for lmc.runtime.radix_cache.RadixCache over a real SlotAllocator.

The stateful test drives the cache with random insert / match / peek / lock / unlock / evict sequences over a
tiny token alphabet (so prefixes collide, edges split and evictions cascade) and compares it against a plain
reference model: a dict from every cached prefix (a token tuple) to the slot the tree holds for its last token,
plus the list of held locks (node, path).
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
hypothesis = pytest.importorskip("hypothesis")

from hypothesis import given, settings, strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule  # noqa: E402

from lmc.runtime.memory import SlotAllocator  # noqa: E402
from lmc.runtime.radix_cache import RadixCache, common_prefix_len  # noqa: E402

TOKENS = st.integers(0, 3)
KEYS = st.lists(TOKENS, min_size=1, max_size=12).map(tuple)
SUFFIXES = st.lists(TOKENS, min_size=0, max_size=6).map(tuple)
# Choices among state-dependent collections are drawn as a plain index taken modulo the length (and rules on an
# empty collection are no-ops rather than preconditions): the cache's eviction order among leaves with equal
# last_access depends on set iteration order (object addresses), so the state reached by one choice sequence
# can differ between runs, and hypothesis rejects draws whose bounds depend on such state as flaky.
INDEX = st.integers(0, 1 << 16)


def node_path(cache: RadixCache, node) -> tuple:
    """Concatenation of the edge keys from the root down to `node`."""
    parts = []
    while node is not cache.root:
        parts.append(node.key)
        node = node.parent
    return tuple(t for part in reversed(parts) for t in part)


def attached(cache: RadixCache, node) -> bool:
    """Whether `node` is still reachable from the root (i.e. not evicted)."""
    while node is not cache.root:
        parent = node.parent
        if parent is None or not node.key or parent.children.get(node.key[0]) is not node:
            return False
        node = parent
    return True


def tree_prefix_slots(cache: RadixCache) -> dict[tuple, int]:
    """Every prefix the tree caches -> the slot of its last token, read off the tree structure."""
    out: dict[tuple, int] = {}
    stack = [(cache.root, ())]
    while stack:
        node, path = stack.pop()
        for child in node.children.values():
            vals = child.value.tolist()
            p = path
            for tok, slot in zip(child.key, vals):
                p = p + (tok,)
                assert p not in out, f"prefix {p} cached twice"
                out[p] = slot
            stack.append((child, p))
    return out


def tree_snapshot(cache: RadixCache):
    nodes = sorted(
        (id(n), n.key, tuple(n.value.tolist()), n.lock_ref, n.last_access, id(n.parent),
         tuple(sorted((k, id(c)) for k, c in n.children.items())))
        for n in cache.nodes())
    return nodes, cache.evictable_size, cache.protected_size, sorted(map(id, cache._leaves))


# ---------------------------------------------------------------------------------------------------------------
# Stateful test against a reference model
# ---------------------------------------------------------------------------------------------------------------
class RadixCacheMachine(RuleBasedStateMachine):

    @initialize(num_slots=st.integers(64, 200))
    def setup(self, num_slots):
        self.num_slots = num_slots
        self.allocator = SlotAllocator(num_slots)
        self.freed_log: list[list[int]] = []

        def free(slots):
            self.freed_log.append(slots.tolist())
            self.allocator.free(slots)

        self.cache = RadixCache(free)
        self.ref: dict[tuple, int] = {}  # cached prefix -> the tree's slot for its last token
        self.locks: list[tuple[object, tuple]] = []  # held locks: (node, path it ends at)
        self.matched: list[tuple[object, tuple]] = []  # recently matched nodes (candidates for lock)
        self.held: list[torch.Tensor] = []  # slots owned outside the tree (a running request's fresh KV)

    # ---- reference helpers -------------------------------------------------------------------------------------
    def ref_prefix_len(self, key: tuple) -> int:
        n = 0
        while n < len(key) and key[:n + 1] in self.ref:
            n += 1
        return n

    def ref_slots(self, key: tuple, n: int) -> list[int]:
        return [self.ref[key[:i + 1]] for i in range(n)]

    def protected_prefixes(self) -> set[tuple]:
        return {path[:i] for _, path in self.locks for i in range(1, len(path) + 1)}

    def do_evict(self, n: int) -> int:
        protected = self.protected_prefixes()
        evictable_before = len(self.ref) - len(protected)
        assert self.cache.evictable_size == evictable_before
        avail_before = self.allocator.available
        self.freed_log.clear()
        freed = self.cache.evict(n)
        log = list(self.freed_log)
        self.freed_log.clear()
        sizes = [len(x) for x in log]
        assert freed == sum(sizes), "evict's return value disagrees with the slots it freed"
        assert freed >= min(n, evictable_before), (freed, n, evictable_before)
        if log:
            assert sum(sizes[:-1]) < n, "evict kept going after it had freed enough"
        assert self.allocator.available == avail_before + freed, "evicted slots did not go back to the allocator"
        freed_slots = [s for x in log for s in x]
        assert len(set(freed_slots)) == len(freed_slots), "a slot was freed twice"
        gone = {p for p, s in self.ref.items() if s in set(freed_slots)}
        assert len(gone) == freed, "evicted slots are not exactly the slots of the evicted prefixes"
        assert not (gone & protected), f"evicted locked prefixes {gone & protected}"
        for p in gone:
            del self.ref[p]
        for p in self.ref:  # eviction only removes leaves: what remains is prefix-closed
            assert len(p) == 1 or p[:-1] in self.ref, f"{p} survived but its prefix {p[:-1]} was evicted"
        for _, path in self.locks:  # locked paths still match fully
            assert len(self.cache.peek(path)) == len(path)
        return freed

    def alloc(self, n: int):
        slots = self.allocator.alloc(n)
        if slots is None:  # what the runtime does: evict the shortfall, then retry
            self.do_evict(n - self.allocator.available)
            slots = self.allocator.alloc(n)
        return slots

    def check_match(self, key: tuple):
        expect = self.ref_prefix_len(key)
        slots, node = self.cache.match(key)
        assert len(slots) == expect, (key, slots.tolist(), expect)
        assert slots.tolist() == self.ref_slots(key, expect)
        assert node_path(self.cache, node) == key[:expect], "match's node does not end at the match"
        return slots, node

    # ---- rules -------------------------------------------------------------------------------------------------
    def _insert(self, key: tuple, slots: torch.Tensor, owned_from: int = 0) -> int:
        """Insert key -> slots, where the caller owns slots[owned_from:] (the rest are the tree's own)."""
        expect = self.ref_prefix_len(key)
        already = self.cache.insert(key, slots)
        assert already == expect, (key, already, expect)
        assert already >= owned_from
        self.allocator.free(slots[owned_from:already])  # the duplicates the caller still owns
        for i in range(already, len(key)):
            self.ref[key[:i + 1]] = int(slots[i])
        return already

    @rule(key=KEYS)
    def insert(self, key):
        slots = self.alloc(len(key))
        if slots is None:
            return
        self._insert(key, slots)

    @rule(i=INDEX, cut=INDEX, suffix=SUFFIXES)
    def insert_extension(self, i, cut, suffix):
        """Insert a key that shares a prefix (possibly ending inside an edge) with something cached."""
        if not self.ref:
            return
        prefixes = sorted(self.ref)
        base = prefixes[i % len(prefixes)]
        key = base[:1 + cut % len(base)] + suffix
        slots = self.alloc(len(key))
        if slots is None:
            return
        self._insert(key, slots)

    @rule(i=INDEX, suffix=SUFFIXES)
    def extend_locked(self, i, suffix):
        """The runtime's _cache_unfinished: a request holding a lock on `path` inserts path + suffix with the
        tree's slots for path and fresh ones for the rest, then moves its lock to the new node."""
        if not self.locks:
            return
        i %= len(self.locks)
        node, path = self.locks[i]
        prefix = self.cache.peek(path)
        assert prefix.tolist() == self.ref_slots(path, len(path))
        fresh = self.alloc(len(suffix))
        if fresh is None:
            return
        key = path + suffix
        if not key:
            self.allocator.free(fresh)
            return
        self._insert(key, torch.cat([prefix, fresh]), owned_from=len(path))
        _, new_node = self.check_match(key)
        self.cache.lock(new_node)
        self.cache.unlock(node)
        self.locks[i] = (new_node, key)

    @rule(key=KEYS)
    def match(self, key):
        _, node = self.check_match(key)
        self.matched = (self.matched + [(node, node_path(self.cache, node))])[-16:]

    @rule(key=KEYS)
    def match_and_lock(self, key):
        _, node = self.check_match(key)
        self.cache.lock(node)
        self.locks.append((node, node_path(self.cache, node)))

    @rule(i=INDEX)
    def lock_matched(self, i):
        if not self.matched:
            return
        node, path = self.matched[i % len(self.matched)]
        if not attached(self.cache, node):  # evicted since it was matched: a stale handle
            return
        assert node_path(self.cache, node) == path, "a matched node's path changed (split must keep identity)"
        self.cache.lock(node)
        self.locks.append((node, path))

    @rule(i=INDEX)
    def unlock(self, i):
        if not self.locks:
            return
        node, path = self.locks.pop(i % len(self.locks))
        assert attached(self.cache, node), "a locked node was evicted"
        assert node_path(self.cache, node) == path
        self.cache.unlock(node)

    @rule(percent=st.integers(1, 100))
    def hold(self, percent):
        """Take slots outside the tree (as resident requests do), so that inserts run short and must evict."""
        room = self.allocator.available + self.cache.evictable_size
        slots = self.alloc(max(1, room * percent // 100))
        if slots is not None:
            self.held.append(slots)

    @rule(i=INDEX)
    def release(self, i):
        if self.held:
            self.allocator.free(self.held.pop(i % len(self.held)))

    @rule(n=st.integers(0, 64))
    def evict(self, n):
        self.do_evict(n)

    @rule()
    def evict_all(self):
        self.do_evict(self.cache.total_size)
        assert self.cache.evictable_size == 0

    @rule(key=KEYS)
    def peek(self, key):
        before = tree_snapshot(self.cache)
        got = self.cache.peek(key)
        assert tree_snapshot(self.cache) == before, "peek changed the tree"
        expect = self.ref_prefix_len(key)
        assert self.cache.prefix_len(key) == expect == len(got)  # the slot-less walk (admission's in-batch check)
        assert got.tolist() == self.ref_slots(key, expect)
        slots, _ = self.check_match(key)
        assert got.tolist() == slots.tolist()

    # ---- invariants --------------------------------------------------------------------------------------------
    @invariant()
    def structure(self):
        self.cache.check()

    @invariant()
    def accounting(self):
        held = sum(len(h) for h in self.held)
        assert self.allocator.available + self.cache.total_size + held == self.num_slots
        every = torch.cat([self.allocator.free_slots(), self.cache.slots(), *self.held])
        assert sorted(every.tolist()) == list(range(1, self.num_slots + 1))

    @invariant()
    def matches_reference(self):
        assert tree_prefix_slots(self.cache) == self.ref
        assert self.cache.total_size == len(self.ref)

    @invariant()
    def locks_match_reference(self):
        protected = self.protected_prefixes()
        assert self.cache.protected_size == len(protected)
        assert self.cache.evictable_size == len(self.ref) - len(protected)
        assert protected <= self.ref.keys()
        lock_paths = [path for _, path in self.locks]
        for node in self.cache.nodes():
            if node is self.cache.root:
                continue
            p = node_path(self.cache, node)
            want = sum(1 for lp in lock_paths if lp[:len(p)] == p)
            assert node.lock_ref == want, (p, node.lock_ref, want)

    def teardown(self):
        # Release everything: the tree must drain completely back into the allocator.
        if not hasattr(self, "cache"):
            return
        for node, _ in self.locks:
            self.cache.unlock(node)
        self.locks = []
        for h in self.held:
            self.allocator.free(h)
        self.held = []
        self.do_evict(self.cache.total_size)
        self.cache.check()
        assert self.cache.total_size == 0 and not self.ref
        assert self.allocator.available == self.num_slots


RadixCacheMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestRadixCacheStateful = RadixCacheMachine.TestCase


# ---------------------------------------------------------------------------------------------------------------
# common_prefix_len
# ---------------------------------------------------------------------------------------------------------------
def naive_cpl(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 3), max_size=300).map(tuple), st.lists(st.integers(0, 3), max_size=300).map(tuple))
def test_common_prefix_len_random(a, b):
    assert common_prefix_len(a, b) == naive_cpl(a, b)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(-5, 5), min_size=1, max_size=400).map(tuple), st.data())
def test_common_prefix_len_shared_prefix(base, data):
    """Two sequences that agree up to a chosen position and then differ (or one ends there)."""
    i = data.draw(st.integers(0, len(base)))
    tail_a = data.draw(st.lists(st.integers(-5, 5), max_size=50).map(tuple))
    tail_b = data.draw(st.lists(st.integers(-5, 5), max_size=50).map(tuple))
    a, b = base[:i] + tail_a, base[:i] + tail_b
    assert common_prefix_len(a, b) == naive_cpl(a, b)
    assert common_prefix_len(b, a) == naive_cpl(a, b)


@pytest.mark.parametrize("length", [1, 2, 3, 15, 16, 17, 31, 32, 33, 47, 48, 49, 100, 111, 255, 256, 257, 300])
def test_common_prefix_len_mismatch_at_every_position(length):
    a = tuple(range(length))
    assert common_prefix_len(a, a) == length
    assert common_prefix_len((), a) == 0
    for i in range(length):
        b = a[:i] + (-1,) + a[i + 1:]
        assert common_prefix_len(a, b) == i, i
        assert common_prefix_len(b, a) == i, i
        assert common_prefix_len(a, a[:i]) == i  # one is a prefix of the other
        assert common_prefix_len(a[:i] + (-1,) * 5, a) == i


# ---------------------------------------------------------------------------------------------------------------
# Unit tests
# ---------------------------------------------------------------------------------------------------------------
def make(num_slots: int = 64):
    allocator = SlotAllocator(num_slots)
    return allocator, RadixCache(allocator.free)


def put(allocator, cache, key) -> tuple[int, list[int]]:
    key = tuple(key)
    slots = allocator.alloc(len(key))
    already = cache.insert(key, slots)
    allocator.free(slots[:already])
    return already, slots.tolist()


A, B, C, D, X, Y = (ord(c) for c in "abcdxy")


def test_split_on_partial_match():
    allocator, cache = make()
    _, slots = put(allocator, cache, (A, B, C, D))
    (child,) = cache.root.children.values()
    got, node = cache.match((A, B, X, Y))
    cache.check()
    assert got.tolist() == slots[:2]
    assert node.key == (A, B) and node_path(cache, node) == (A, B)
    assert node.parent is cache.root and cache.root.children[A] is node
    assert list(node.children.values()) == [child] and child.key == (C, D) and child.parent is node
    assert child.value.tolist() == slots[2:] and node.value.tolist() == slots[:2]
    assert cache.total_size == 4 and cache.evictable_size == 4
    assert cache._leaves == {child}
    # a match ending inside the remaining edge splits it too
    got, node2 = cache.match((A, B, C))
    cache.check()
    assert got.tolist() == slots[:3] and node2.key == (C,) and node2.parent is node
    # and a full match returns the original (lower) node object
    got, node3 = cache.match((A, B, C, D, X))
    assert got.tolist() == slots and node3 is child and child.key == (D,)
    assert cache.peek((A, B, C, D)).tolist() == slots


def test_insert_returns_already_cached_length():
    allocator, cache = make()
    assert put(allocator, cache, (1, 2, 3, 4))[0] == 0
    assert put(allocator, cache, (1, 2, 5))[0] == 2
    assert put(allocator, cache, (1, 2, 3, 4, 5))[0] == 4
    assert put(allocator, cache, (1, 2))[0] == 2
    assert put(allocator, cache, (1, 2, 3, 4))[0] == 4
    assert put(allocator, cache, (9,))[0] == 0
    assert put(allocator, cache, ())[0] == 0
    cache.check()
    assert cache.total_size == 7  # 1 2 | 3 4 | 5 , 5 , 9
    assert allocator.available + cache.total_size == 64


def test_insert_keeps_first_inserters_slots():
    allocator, cache = make()
    _, first = put(allocator, cache, (1, 2, 3))
    _, second = put(allocator, cache, (1, 2, 3, 4))
    assert cache.match((1, 2, 3, 4))[0].tolist() == first + second[3:]
    assert sorted(allocator.free_slots().tolist() + cache.slots().tolist()) == list(range(1, 65))


def test_tree_keeps_its_own_copy_of_slots():
    """The tree must not alias the caller's tensor: the runtime reuses its slot rows after inserting."""
    allocator, cache = make()
    slots = allocator.alloc(4)
    expect = slots.tolist()
    cache.insert((1, 2, 3, 4), slots)
    slots.fill_(0)
    assert cache.match((1, 2, 3, 4))[0].tolist() == expect
    got, _ = cache.match((1, 2))  # split halves too
    got.fill_(0)
    assert cache.peek((1, 2, 3, 4)).tolist() == expect


def test_lock_ref_inherited_on_split():
    allocator, cache = make()
    put(allocator, cache, (1, 2, 3, 4))
    _, node = cache.match((1, 2, 3, 4))
    cache.lock(node)
    assert cache.protected_size == 4 and cache.evictable_size == 0
    _, mid = cache.match((1, 2, 9))
    cache.check()
    assert mid.key == (1, 2) and node.key == (3, 4) and node.parent is mid
    assert mid.lock_ref == 1 and node.lock_ref == 1
    assert cache.protected_size == 4 and cache.evictable_size == 0
    assert cache.evict(100) == 0
    cache.unlock(node)
    cache.check()
    assert mid.lock_ref == 0 and node.lock_ref == 0
    assert cache.protected_size == 0 and cache.evictable_size == 4
    assert cache.evict(100) == 4
    cache.check()
    assert allocator.available == 64


def test_lock_twice_and_split_between_locks():
    allocator, cache = make()
    put(allocator, cache, (1, 2, 3, 4, 5, 6))
    _, deep = cache.match((1, 2, 3, 4, 5, 6))
    cache.lock(deep)
    _, shallow = cache.match((1, 2, 3))  # splits the locked edge; lock the upper half once more
    cache.lock(shallow)
    cache.check()
    assert shallow.lock_ref == 2 and deep.lock_ref == 1 and cache.protected_size == 6
    cache.unlock(deep)
    cache.check()
    assert cache.protected_size == 3 and cache.evictable_size == 3
    assert cache.evict(100) == 3 and cache.peek((1, 2, 3, 4)).tolist() == cache.match((1, 2, 3))[0].tolist()
    cache.unlock(shallow)
    assert cache.evict(100) == 3
    cache.check()
    assert allocator.available == 64


def test_disabled_cache():
    allocator = SlotAllocator(16)
    cache = RadixCache(allocator.free, disabled=True)
    slots = allocator.alloc(4)
    assert cache.insert((1, 2, 3, 4), slots) == 0
    got, node = cache.match((1, 2, 3, 4))
    assert len(got) == 0 and node is cache.root
    assert len(cache.peek((1, 2, 3, 4))) == 0
    assert cache.total_size == 0 and not cache.root.children and len(cache.slots()) == 0
    assert cache.evict(10) == 0
    cache.lock(node)
    cache.unlock(node)
    cache.check()


def test_empty_key():
    allocator, cache = make()
    got, node = cache.match(())
    assert len(got) == 0 and node is cache.root
    assert cache.insert((), torch.empty(0, dtype=torch.int64)) == 0
    cache.check()


def test_eviction_is_lru_over_leaves():
    allocator, cache = make()
    _, a = put(allocator, cache, (1, 1, 1))
    _, b = put(allocator, cache, (2, 2, 2))
    _, c = put(allocator, cache, (3, 3, 3))
    cache.match((1, 1, 1))  # touch the oldest
    freed = []
    cache.free_slots = lambda s: (freed.append(s.tolist()), allocator.free(s))
    assert cache.evict(3) == 3
    cache.check()
    assert freed == [b], "the least recently used leaf must go first"
    assert cache.peek((1, 1, 1)).tolist() == a and cache.peek((3, 3, 3)).tolist() == c
    assert len(cache.peek((2, 2, 2))) == 0
    assert cache.evict(1) == 3 and freed[-1] == c  # then the next least recently used (c, untouched since insert)
    assert cache.peek((1, 1, 1)).tolist() == a
    cache.check()


def test_eviction_cascades_to_childless_parent():
    allocator, cache = make()
    _, p = put(allocator, cache, (1, 2, 3))
    _, q = put(allocator, cache, (1, 2, 3, 4, 5))
    _, r = put(allocator, cache, (7, 8))  # newest: must survive the cascade
    parent = cache.root.children[1]
    assert parent.key == (1, 2, 3) and parent not in cache._leaves
    freed = []
    cache.free_slots = lambda s: (freed.append(s.tolist()), allocator.free(s))
    assert cache.evict(2) == 2 and freed == [q[3:]]
    cache.check()
    assert parent in cache._leaves, "a parent left childless and unlocked must become an eviction candidate"
    assert cache.evict(3) == 3 and freed[-1] == p
    assert cache.peek((7, 8)).tolist() == r
    cache.check()
    # in one call: evicting the leaf cascades into the now-childless parent before the newer key
    put(allocator, cache, (1, 2, 3))
    put(allocator, cache, (1, 2, 3, 4, 5))
    cache.match((7, 8))
    freed.clear()
    assert cache.evict(5) == 5 and len(freed) == 2 and len(freed[0]) == 2 and len(freed[1]) == 3
    assert len(cache.peek((7, 8))) == 2 and len(cache.peek((1,))) == 0
    cache.check()
    assert allocator.available + cache.total_size == 64


def test_eviction_does_not_cascade_into_locked_parent():
    allocator, cache = make()
    put(allocator, cache, (1, 2, 3))
    put(allocator, cache, (1, 2, 3, 4, 5))
    put(allocator, cache, (7, 8))
    _, parent = cache.match((1, 2, 3))
    cache.lock(parent)
    assert cache.evict(100) == 4
    cache.check()
    assert len(cache.peek((1, 2, 3, 4, 5))) == 3 and parent not in cache._leaves and not parent.children
    cache.unlock(parent)
    cache.check()
    assert parent in cache._leaves
    assert cache.evict(100) == 3 and allocator.available == 64
