"""CacheManager: owns the slot-table rows, the KV slots and the radix tree. Every change of who owns a slot
happens here, so the slot accounting is written once.

Slot accounting invariant (`check()`, after every step in tests): each slot 1..num_slots is exactly one of
- free (in the allocator),
- owned by the radix tree (evictable or protected),
- owned by a resident request: its row positions [own_from(r), kv_len),
- owned by a shared block (below), where the tree does not own it yet.
Per resident request: cache_protected_len <= kv_done <= kv_len (core.Req), and its row's first
cache_protected_len slots are the tree's slots for its first cache_protected_len tokens.

Shared blocks (prefill.py: a request sharing the prompt of a prefill forward still in flight): the lender's new
slots of that forward, [start, end) of its row, become a `SharedBlock`'s, and each borrower's row points at the
part it shares (positions [cache_protected_len, block_end)), so it computes only the rest, in the next forward,
which runs after the lender's on the device. A holder (lender or borrower) leaves the block once its own KV went
to the tree (cache_unfinished) or when it lets go of its KV (release); the block locks the tree's copy of its
prefix while holders remain, and the last to leave frees the block's slots that the tree did not take.

Only KV that a completed forward computed (positions < kv_done) enters the tree: slots allocated for a forward
still in flight are freed when their request lets go of them. Such a slot may be handed out again while the old
forward still writes it; the new owner's forward runs after it on the device (one stream, or one worker thread),
so the later write wins.

The slot table exists twice. `table` here is the scheduler's host copy, the only one the scheduler reads. The
runner's device copy receives every write: the slots of a batch's new tokens travel with that batch, and the
other writes (a request adopting cached slots for its prefix) are recorded in `pending` as the range of each row
they touched and go with the next batch, with the host's values of that moment (take_pending): one write per
row, so a row written twice before a batch (adopted twice, or by a released request and then by the row's next
owner) reaches the device with its latest slots. (A CUDA index_put with duplicate indices keeps an arbitrary one
of the values: the stale slots of a row's previous owner won on the GPU and the next request attended to another
request's KV.)

Retention by the plan (issue 14): `programs` is the ProgramLedger of the instances whose requests carry hints. A
finished hinted request's prefix node is tagged with its next use, and while the program policy schedules
(`programs.retaining`), eviction goes by those tags before recency (programs.py has the order).
"""
from __future__ import annotations

import time

import numpy as np
import torch

from ..core import Req
from ..memory import RowAllocator, SlotAllocator
from ..radix_cache import RadixCache
from .programs import ProgramLedger


class SharedBlock:
    """The slots of positions [start, end) of a lender's prompt (`key` = its tokens [0, end)), computed by its
    forward in flight, shared by the holders still pointing at them."""

    def __init__(self, lender: Req, start: int, end: int, slots: torch.Tensor):
        self.lender, self.start, self.end, self.slots = lender, start, end, slots
        self.key = tuple(lender.fill_ids[:end])
        self.holders = 1  # the lender
        self.computed = False  # the lender's forward was collected (a redo without it cannot fill the slots)
        self.node = None  # tree node this block locks (its prefix, once a holder inserted it)


def own_from(r: Req) -> int:
    """The first position of r's row whose slot r owns (before: the tree's, then a shared block's)."""
    return max(r.cache_protected_len, r.block_end)


class CacheManager:
    def __init__(self, num_rows: int, context_length: int, num_slots: int, *, disabled: bool = False,
                 stats: dict | None = None):
        # numpy's zeros (untouched pages), not torch's: the host's threads run no OpenMP region (runner.py)
        self._table_np = np.zeros((num_rows, context_length), dtype=np.int32)
        self.table = torch.from_numpy(self._table_np)  # the same memory: a decode step's few writes go to numpy
        # Bumped by every admission and every write below a request's new tokens (_written): what shared_prefix's
        # answer depends on
        self._layout = 0
        self._shared_memo: tuple = ()
        self.rows = RowAllocator(num_rows)
        self.slots = SlotAllocator(num_slots)
        self.tree = RadixCache(self.slots.free, disabled=disabled)
        self.pending: dict[int, tuple[int, int]] = {}  # row -> [lo, hi): its positions written since the last batch
        self.stats = stats if stats is not None else {"cache_seconds": 0.0}  # time spent in tree operations
        self.programs = ProgramLedger()
        self.blocks: set[SharedBlock] = set()

    @property
    def room(self) -> int:
        """Slots that can be had now: free plus evictable."""
        return self.slots.available + self.tree.evictable_size

    def take_pending(self) -> list[tuple[int, int, torch.Tensor]]:
        """The device table's writes for the next batch: (row, start, slots), one per row written since the last
        batch, its range the union of what was written there (gaps included: the host copy is right everywhere)."""
        out = [(row, lo, self.table[row, lo:hi].long()) for row, (lo, hi) in self.pending.items()]
        self.pending = {}
        return out

    def _written(self, row: int, lo: int, hi: int) -> None:
        """Host table row `row`, positions [lo, hi), changed outside a batch's new tokens: pending for the device."""
        if hi > lo:
            self._layout += 1
            a, b = self.pending.get(row, (lo, hi))
            self.pending[row] = (min(a, lo), max(b, hi))

    # ---- admission ---------------------------------------------------------------------------------------------
    def match(self, key) -> tuple[torch.Tensor, object]:
        t0 = time.perf_counter()
        try:
            return self.tree.match(key)
        finally:
            self.stats["cache_seconds"] += time.perf_counter() - t0

    def admit(self, r: Req) -> bool:
        """Make r resident on its matched prefix (already locked by the caller): a row, the prefix's slots in it.
        False when no row is free."""
        row = self.rows.alloc()
        if row is None:
            return False
        self._layout += 1  # the row's new owner writes its columns from 0 on: what shared_prefix kept is stale
        p = len(r.prefix_slots)
        if p:
            self.table[row, :p] = r.prefix_slots.to(torch.int32)
            self._written(row, 0, p)
        r.row, r.last_node = row, r.match_node
        r.cache_protected_len = r.kv_done = r.kv_len = p
        return True

    def extend(self, r: Req, n: int) -> torch.Tensor:
        """Allocate slots for r's next n positions (evicting cached prefixes if needed); they are r's now."""
        slots = self._alloc(n)
        self.table[r.row, r.kv_len:r.kv_len + n] = slots.to(torch.int32)
        r.kv_len += n
        return slots

    def extend_each(self, reqs: list[Req]) -> tuple[list[int], torch.Tensor]:
        """One slot for the next position of each request (a decode step). Returns the positions and slots."""
        slots = self._alloc(len(reqs))
        positions = [r.kv_len for r in reqs]
        self._table_np[[r.row for r in reqs], positions] = slots.numpy()
        for r in reqs:
            r.kv_len += 1
        return positions, slots

    def borrow(self, r: Req, lender: Req, start: int, end: int, upto: int) -> None:
        """Point admitted r's positions [kv_len, upto) at the lender's slots there: the lender's forward in flight
        computes positions [start, end) of the same tokens (prefill.py). r computes from `upto` on."""
        b = lender.block
        if b is None:
            b = SharedBlock(lender, start, end, self.table[lender.row, start:end].long().clone())
            lender.block, lender.block_end = b, end
            self.blocks.add(b)
        lo = r.kv_len
        slots = b.slots[lo - b.start:upto - b.start]
        self.table[r.row, lo:upto] = slots.to(torch.int32)
        self._written(r.row, lo, upto)
        r.block, r.block_end, r.kv_len = b, upto, upto
        b.holders += 1

    def _leave(self, r: Req) -> None:
        """r no longer points at its block's slots (its KV went to the tree, or it let go of it)."""
        b, r.block, r.block_end = r.block, None, 0
        if b is None:
            return
        b.holders -= 1
        if b.holders:
            self._guard(b)
            return
        self.blocks.discard(b)
        if b.node is not None:
            self.tree.unlock(b.node)
        self.slots.free(b.slots[~self._in_tree(b)])

    def _in_tree(self, b: SharedBlock) -> torch.Tensor:
        """Which of b's slots the tree owns (a holder inserted them)."""
        cached = self.tree.peek(b.key)[b.start:]
        mine = torch.zeros(len(b.slots), dtype=torch.bool)
        n = min(len(cached), len(b.slots))
        mine[:n] = cached[:n] == b.slots[:n]
        return mine

    def _guard(self, b: SharedBlock) -> None:
        """Lock the tree's copy of b's prefix while holders still point at it (eviction would free its slots)."""
        if self.tree.disabled:
            return
        slots, node = self.tree.match(b.key)
        if len(slots) > b.start and node is not b.node:
            self.tree.lock(node)
            if b.node is not None:
                self.tree.unlock(b.node)
            b.node = node

    def shared_prefix(self, reqs: list[Req]) -> int:
        """How many leading positions every request of a batch holds in the same slots (a radix-cache prefix they
        all matched): the decode attention can read those once for the batch. Only tree-owned positions, below
        every request's cache_protected_len, and a shared block's, below its block_end, can agree, and there
        agreement is prefix-closed (a tree slot at position p implies the tree's path up to p, a block's slot the
        block's key), so a binary search over columns finds the end in
        O(B log n): unrelated prompts end at the first column, a batch on one prompt at the last. Columns below a
        request's own_from change only at an admission or through _written (a borrowed block, adopted tree slots),
        so the answer is kept for the same rows and n until then: a decode loop searches once (`check` verifies
        it)."""
        n = min((own_from(r) for r in reqs), default=0)
        if len(reqs) < 2 or n == 0:
            return 0
        key = (self._layout, n, *(r.row for r in reqs))
        if self._shared_memo[:-1] == key:
            return self._shared_memo[-1]
        found = self._search_shared([r.row for r in reqs], n)
        self._shared_memo = (*key, found)
        return found

    def _search_shared(self, rows: list[int], n: int) -> int:
        def agree(p: int) -> bool:
            col = self._table_np[rows, p]
            return bool((col == col[0]).all())

        if not agree(0):
            return 0
        if agree(n - 1):
            return n
        lo, hi = 1, n - 1  # columns < lo agree, column hi does not
        while lo < hi:
            mid = (lo + hi) // 2
            if agree(mid):
                lo = mid + 1
            else:
                hi = mid
        return lo

    def _alloc(self, n: int) -> torch.Tensor:
        slots = self.slots.alloc(n)
        if slots is None:
            self.evict(n - self.slots.available)
            slots = self.slots.alloc(n)
        assert slots is not None, "admission budget admitted more than fits"
        return slots

    def evict(self, n: int) -> None:
        if n > 0:
            t0 = time.perf_counter()
            self.tree.evict(n, self.programs.eviction_key if self.programs.retaining else None)
            self.stats["cache_seconds"] += time.perf_counter() - t0

    # ---- progress and release ----------------------------------------------------------------------------------
    def truncate(self, r: Req, keep: int) -> None:
        """Drop r's KV past `keep` positions: free the slots r owns there (the tree's stay in the tree)."""
        if keep < r.kv_len:
            lo = max(keep, own_from(r))
            if lo < r.kv_len:
                self.slots.free(self.table[r.row, lo:r.kv_len].long())
            r.kv_len, r.kv_done = keep, min(r.kv_done, keep)
            if r.block is not None and keep < r.block_end:
                r.block_end = max(keep, r.cache_protected_len)
                if r.block_end <= r.cache_protected_len:
                    self._leave(r)

    def release(self, r: Req) -> None:
        """Hand r's computed KV to the tree (duplicates of what the tree already holds are freed), free the slots
        of positions not computed yet, unlock, free the row, and start a new epoch (its scheduled entries are
        stale now)."""
        r.epoch += 1
        if r.row < 0:
            return
        t0 = time.perf_counter()
        slots = self.table[r.row, :r.kv_len].long()
        done, own = r.kv_done, own_from(r)
        if self.tree.disabled:
            self.slots.free(slots[own:])
        else:
            already = self.tree.insert(r.fill_ids[:done], slots[:done])
            self.slots.free(slots[own:already])
            self.slots.free(slots[max(done, own):])
            self.tree.unlock(r.last_node)
            self._retain(r, done)
        self._leave(r)
        self.pending.pop(r.row, None)  # nothing reads the row before its next owner writes it
        self.rows.free(r.row)
        r.row, r.kv_len, r.kv_done, r.cache_protected_len, r.last_node = -1, 0, 0, 0, None
        self.stats["cache_seconds"] += time.perf_counter() - t0

    def _retain(self, r: Req, done: int) -> None:
        """Count r's service in its instance and, once r is finished, tag the node ending at its computed tokens
        with their next use (the node is unlocked now: the tag orders its eviction)."""
        st = self.programs.released(r)
        if st is None or not r.finished or not done:
            return
        _, node = self.tree.match(r.fill_ids[:done])
        if node is not self.tree.root:
            node.retain = self.programs.tag(r, st)

    def cache_unfinished(self, r: Req) -> None:
        """Insert r's computed tokens into the tree while it keeps running (so requests queued behind it can
        share them), adopt the tree's slots for positions it already held, and move r's lock to the new node."""
        if self.tree.disabled:
            return
        t0 = time.perf_counter()
        done, protected = r.kv_done, r.cache_protected_len
        key = r.fill_ids[:done]
        slots = self.table[r.row, :done].long()
        already = self.tree.insert(key, slots)
        canonical, node = self.tree.match(key)
        # Positions the tree already held: r's own slots there are duplicates (freed); a block's slots there are
        # the tree's when a holder inserted them, else the block frees them when its last holder leaves.
        if already > protected and not torch.equal(slots[protected:already], canonical[protected:already]):
            self.slots.free(slots[own_from(r):already])
            adopted = canonical[protected:already]
            self.table[r.row, protected:already] = adopted.to(torch.int32)
            self._written(r.row, protected, already)
        self.tree.lock(node)
        self.tree.unlock(r.last_node)
        r.last_node, r.cache_protected_len = node, done
        self._leave(r)
        self.stats["cache_seconds"] += time.perf_counter() - t0

    def adopt(self, r: Req, key) -> int:
        """Point resident r's leading positions at the tree's cached prefix of `key` (r's next tokens) where it
        reaches past r's own KV, so that r computes only what the tree lacks (a chain's next call, whose text an
        earlier request cached). r's own slots there hold the same tokens' KV as the tree's: they are freed. Only
        with nothing of r in flight (kv_done == kv_len). Returns r's kv_len after."""
        if self.tree.disabled or r.kv_done != r.kv_len:
            return r.kv_len
        slots, node = self.match(key)
        n = len(slots)
        if n <= r.kv_len:
            return r.kv_len
        self.slots.free(self.table[r.row, own_from(r):r.kv_len].long())
        self.table[r.row, :n] = slots.to(torch.int32)
        self._written(r.row, 0, n)
        self.tree.lock(node)
        self.tree.unlock(r.last_node)
        r.last_node, r.cache_protected_len, r.kv_len, r.kv_done = node, n, n, n
        self._leave(r)
        return n

    # ---- invariants --------------------------------------------------------------------------------------------
    def check(self, resident: list[Req]) -> None:
        """Every slot is exactly one of: free, in the tree, owned by a resident request (module docstring)."""
        self.tree.check()
        owned = [self.table[r.row, own_from(r):r.kv_len].long() for r in resident]
        owned += [b.slots[~self._in_tree(b)] for b in self.blocks]
        free = self.slots.free_slots()
        parts = [free, self.tree.slots(), *owned]
        every = torch.cat(parts)
        total = self.slots.num_slots
        assert len(free) + self.tree.total_size + sum(map(len, owned)) == total, "slot accounting drifted"
        assert len(every) == total and torch.equal(every.sort().values, torch.arange(1, total + 1)), \
            "a slot is lost or owned twice"
        rows = [r.row for r in resident]
        assert len(set(rows)) == len(rows) and min(rows, default=1) >= 1, "a row is owned twice (or the dummy)"
        assert self.rows.available + len(rows) == self.rows.num_rows - 1, "a row is lost"
        holders = dict.fromkeys(self.blocks, 0)
        for r in resident:
            b = r.block
            if b is not None:
                assert b in holders, "a request holds a retired block"
                holders[b] += 1
                assert torch.equal(self.table[r.row, r.cache_protected_len:r.block_end].long(),
                                   b.slots[r.cache_protected_len - b.start:r.block_end - b.start]), \
                    "a borrowed prefix disagrees with its block"
        assert all(b.holders == n for b, n in holders.items()), "a block's holder count drifted"
        if self._shared_memo and self._shared_memo[0] == self._layout:
            _, n, *kept_rows, kept = self._shared_memo
            assert self._search_shared(kept_rows, n) == kept, "the kept shared prefix is stale"
        for r in resident:
            assert r.last_node is not None
            assert r.cache_protected_len <= r.kv_done <= r.kv_len <= r.seq_len, "KV lengths out of order"
            if not self.tree.disabled:
                tree_slots = self.tree.peek(r.fill_ids[:r.cache_protected_len])
                assert torch.equal(tree_slots, self.table[r.row, :r.cache_protected_len].long()), \
                    "a request's shared prefix disagrees with the tree"
