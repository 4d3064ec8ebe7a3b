"""Prefill admission: which waiting requests enter the next forward, and how many of their tokens.

The waiting queue is matched against the radix tree and ordered by the policy. Requests are taken in that order
while the budgets hold (SGLang's PrefillAdder):
- `max_prefill_tokens` new tokens per batch (the first request is always taken) and `chunked_prefill_size` per
  batch; a request longer than what is left is prefilled in chunks, at most one such request at a time, and its
  next chunk goes first in the next prefill;
- KV room: free + evictable slots minus what the running requests are expected to still need
  (`new_token_ratio` x their remaining tokens, clipped at CLIP_NEW_TOKENS each; a chain's remaining tokens include
  its later texts and calls, which it computes without admission: counting only its running call over-admitted
  chains on a small pool, and the retractions that followed recomputed their whole prefixes);
- `max_running` requests, and a free slot-table row.
In-batch prefix dedup (cache-aware policies): a request whose usable prefix (match_limit) another request of this
batch, the chunked request's later chunks, or the prefill forward still in flight (overlap) is about to compute
waits a step, then hits the cache; except the choice children of a select's latency fusion (continuation.py),
whose point is the forward saved, and a request that shares the prompt of one request of the forward in flight
(overlap: it computes that prompt from its cached prefix to its end): it borrows those slots (a shared block,
cache.py) and computes only the rest, in the next forward, which the device runs after the one in flight. So a
batch of programs on one long prefix is admitted while the first one's prefill runs, not after it (the GPU sat
idle for that admission, ~18 ms for gpu_bench's 127 few-shot programs). A batch of short jump-forward extends carries the running requests' decode
step too (mixing), so a jump costs no extra forward.

Forward shaping (`SchedulerConfig.busy_prefill_tokens`, off by default; while program instances run): while
requests decode, a prefill batch takes at most that many new tokens, in the policy's order with the chunked
request's next chunk ranked among the queue (a request that would need a second chunked prompt is passed over, not
a stop), and the running requests decode in the same forward.

A chain request between two calls (`continuing`, continuation.py) goes first: resident with its KV, it needs no
admission and no match, only room for its next chunk; a batch of short such extends mixes in the running
requests' decode step like jump-forward extends, and so do the choice children of a chain's select. With
`SchedulerConfig.chain_batch_steps` (a device whose decode steps replay CUDA graphs), chains wait while requests
decode, until one has waited that many steps or as many chains wait as requests decode: their extends then share
one eager forward.

A request whose last chunk is scheduled joins `running` at once, before its forward has run: with overlap the
next decode step is scheduled while this prefill is still in flight, and reads its first token on the device.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..core import Req
from ..radix_cache import RadixCache
from ..runner import BatchBuilder, ScheduledBatch
from . import decode
from .config import CLIP_NEW_TOKENS, IN_BATCH_DEPRIORITIZE, MIX_MAX_EXTEND

if TYPE_CHECKING:
    from .scheduler import Scheduler


def est_new(r: Req) -> int:
    """Admission's estimate of the tokens r may still add to its KV: what its call may still generate, and a
    chain's later texts and calls (continuation.Chain.tokens_after), which it computes without admission."""
    later = r.chain.tokens_after[r.chain.at] if r.chain is not None and r.chain.at >= 0 else 0
    return min(r.params.max_new_tokens - len(r.output_ids) + later, CLIP_NEW_TOKENS)


def match_limit(s: "Scheduler", r: Req) -> int:
    """How many leading tokens of `r` a cached prefix may serve: at least one token is always recomputed (its
    logits are needed), and the positions of prompt logprobs not recorded yet are recomputed too."""
    limit = r.seq_len - 1  # len(fill_ids), without building it
    if r.next_prompt_logprob < len(r.input_ids):
        limit = min(limit, max(r.next_prompt_logprob - 1, 0))
    if r in s.no_match and r.computed_tokens == 0:
        limit = 0  # ablation: compute the whole prompt (the empty key matches the root)
    return limit


def match(s: "Scheduler", r: Req) -> None:
    """Longest cached prefix usable by `r` (match_limit)."""
    if r.match_version == s.cache.version:
        return  # nothing was inserted or evicted since: the match still holds (LPM stays cheap under load)
    r.prefix_slots, r.match_node = s.memory.match(r.fill_ids[:match_limit(s, r)])
    r.match_version = s.cache.version


class PrefillAdder:
    """The budgets of one prefill batch and the batch being built."""

    def __init__(self, s: "Scheduler"):
        self.s, self.mem = s, s.memory
        self.batch = BatchBuilder()
        self.rem_input, self.rem_chunk = s.cfg.max_prefill_tokens, s.cfg.chunked_prefill_size
        # forward shaping, for program instances (plain traffic is batched as SGLang batches it)
        budget = s.cfg.busy_prefill_tokens
        self.shaped = (budget is not None and bool(s.running)
                       and any(r.program is not None for q in (s.running, s.waiting) for r in q))
        if self.shaped:
            self.rem_chunk = min(self.rem_chunk, budget)
        self.reserved = sum(est_new(r) for r in s.running) * s.new_token_ratio
        self.joins: list[Req] = []  # requests whose last chunk is in this batch and that will decode after it

    def take(self, r: Req, ext: int) -> None:
        pre = r.kv_len
        last = pre + ext == r.seq_len
        self.batch.add(r, pre, ext, self.mem.extend(r, ext), last and r.params.max_new_tokens > 0)
        self.rem_input -= ext
        self.rem_chunk -= ext
        if last:
            self.reserved += est_new(r)
            if r.params.max_new_tokens > 0:
                self.joins.append(r)

    def try_admit(self, r: Req, ext: int, chunk: bool, borrow: tuple | None = None) -> bool:
        """Give r a row and lock its cached prefix if its `ext` new tokens plus its expected outputs fit the
        budget. On an idle engine the first request only needs its tokens to fit at all. `borrow`: (lender,
        start, end, upto): r's positions up to `upto` past its cached prefix are the lender's in-flight slots."""
        s, mem = self.s, self.mem
        idle = not len(self.batch) and not s.running
        mem.tree.lock(r.match_node)
        room = mem.room
        need = ext + (0 if chunk else est_new(r))
        if ((idle and ext <= room) or need <= room - self.reserved) and mem.admit(r):
            if borrow is not None:
                mem.borrow(r, *borrow)
            # Prompt tokens served from the cache (or a borrowed block) that r did not compute itself earlier.
            # Output tokens found in the cache (after a jump-forward, another request may have cached the same
            # forced text) are no prompt cache hit: cached_tokens <= prompt_tokens.
            p = r.kv_len
            fresh = max(0, min(p, len(r.input_ids)) - r.computed_tokens)
            r.cached_tokens += fresh
            s.stats["cached_tokens"] += fresh
            s.stats["prompt_tokens"] += len(r.input_ids) if r.computed_tokens == 0 else 0
            return True
        mem.tree.unlock(r.match_node)
        return False


_NO_SLOT = torch.zeros((), dtype=torch.int64)


def _simulate(sim: RadixCache, key) -> None:
    sim.insert(key, _NO_SLOT.expand(len(key)))  # a view: the tree copies only the part it lacks


def _codes(row: int, n: int) -> torch.Tensor:
    """A lender's values in the in-flight tree: its row and each position (row 0, the dummy's, lends nothing)."""
    return torch.arange(n, dtype=torch.int64) + (row << 32)


def in_flight_prefixes(s: "Scheduler") -> tuple[RadixCache, dict[int, tuple[Req, int, int]]]:
    """A tree of the prefixes about to be computed, seeded with those of the prefill forward still in flight
    (overlap): its KV enters the tree only once it is processed, after this batch is scheduled. A request of that
    forward that computes its prompt from its cached prefix to its end is a lender (its positions [start, end)):
    its entries name its row and positions; every other entry is 0. Returns the tree and the lenders by row."""
    sim, lenders = RadixCache(), {}
    f = s._inflight
    if f is not None and not f.sb.is_decode and f.launch is not None and not f.redo:
        riders = set(f.sb.from_buffer)
        for i, (r, pre, ext, epoch) in enumerate(zip(f.sb.reqs, f.sb.prefix_lens, f.sb.extend_lens, f.sb.epochs)):
            if r.epoch != epoch:
                continue
            key = r.fill_ids[:pre + ext]
            if (i not in riders and r.block is None and pre == r.cache_protected_len and pre + ext == r.seq_len
                    and r.kv_len == pre + ext):
                sim.insert(key, _codes(r.row, len(key)))
                lenders[r.row] = (r, pre, pre + ext)
            else:
                _simulate(sim, key)
    return sim, lenders


def _lender(lenders: dict, codes: torch.Tensor, matched: int) -> tuple[Req, int, int] | None:
    """The in-flight request computing all of positions [matched, len(codes)) of a queued request's prompt."""
    row = int(codes[matched]) >> 32
    lend = lenders.get(row)
    if lend is None or matched < lend[1] or not bool(((codes[matched:] >> 32) == row).all()):
        return None
    return lend


def schedule_prefill(s: "Scheduler", batch_chains: bool = True) -> ScheduledBatch | None:
    if not s.continuing and s.chunked is None and not s.waiting:
        return None
    if batch_chains and not s.waiting and s.chunked is None and _chains_wait(s):
        return None
    add = PrefillAdder(s)
    _continue_chains(s, add)
    _admit(s, add)
    if not len(add.batch):
        return None
    b = add.batch
    if (s.running and (add.shaped or (s.chunked is None and max(b.extend_lens) <= MIX_MAX_EXTEND
            and all((r.jumps and r.computed_tokens) or r.chain is not None or r.parent is not None
                    for r in b.reqs)))
            and s.memory.room >= len(s.running)):
        # Only short extends of running work to prefill (a jump-forward's forced tokens, a chain's next text or
        # its select's choices, a chain's first text: a compiled program's next segment after a host break or a
        # fork's branch, whose prefix the tree mostly holds):
        # the running requests decode in the same forward (as 1-token extends, their input token read on the
        # device), so a jump or a chain's next call costs its request no extra forward and the others no stall.
        for r in s.running:
            b.add(r, r.kv_len, 1, s.memory.extend(r, 1), True, from_buffer=True)
        s.stats["mixed_forwards"] += 1
    s.running.extend(add.joins)
    return b.build(s.memory.take_pending())


def _chains_wait(s: "Scheduler") -> bool:
    """Whether this step decodes (a replayed graph) and leaves the waiting chains for a later, shared extend."""
    window = s.cfg.chain_batch_steps
    if not window or not s.running or len(s.continuing) >= len(s.running):
        return False
    return s.stats["forwards"] - min(r.continuing_since for r in s.continuing) < window


def _continue_chains(s: "Scheduler", add: PrefillAdder) -> None:
    """The next chunk of each chain request between two calls (continuation.py): it is resident and holds its
    KV, so it takes no admission and no match, and goes before the queue. One that finds no room while nothing
    runs (nothing will free any) goes back to the queue, whose admission aborts it if it can never fit."""
    for r in list(s.continuing):
        ext = min(len(r.fill_ids) - r.kv_len, add.rem_chunk, s.memory.room)
        if ext <= 0:
            if not s.running and not len(add.batch) and add.rem_chunk > 0:
                decode.requeue(s, r)
                r.computed_tokens = r.cached_tokens = 0
            break
        add.take(r, ext)
        if r.kv_len == len(r.fill_ids):
            s.continuing.remove(r)


def _admit(s: "Scheduler", add: PrefillAdder) -> None:
    """Admit waiting requests into the batch (module docstring)."""
    if s.chunked is None and not s.waiting:
        return
    if s.chunked is None and (len(s.running) + len(add.batch) >= s.cfg.max_running
                              or not s.memory.rows.available):
        return  # nothing could be admitted: skip matching the queue
    for r in s.waiting:
        match(s, r)
    chunked = s.chunked
    # A shaped prefill ranks the chunked prompt's next chunk with the queue; else it continues first.
    queue = s.waiting + [chunked] if add.shaped and chunked is not None else s.waiting
    order = s.policy.order(queue, s.policy_context) if not s.cache.disabled else list(queue)
    sim, lenders = in_flight_prefixes(s) if s.shares_prefixes_in_batch else (None, {})
    if sim is not None:
        for r in add.batch.reqs:  # the chains' next chunks, taken before the queue (_continue_chains)
            _simulate(sim, r.fill_ids[:r.kv_len])
    if chunked is not None:
        if sim is not None:
            _simulate(sim, chunked.fill_ids)  # its later chunks too: a request sharing them waits for the prompt
        if queue is s.waiting:
            _continue_chunked(s, add)
    admitted: set[Req] = set()
    for r in order:
        if add.rem_chunk <= 0 or (len(add.batch) and add.rem_input <= 0):
            break
        if r is chunked:
            _continue_chunked(s, add)
            continue
        if len(s.running) + len(add.batch) >= s.cfg.max_running or not s.memory.rows.available:
            break
        match(s, r)  # again: allocations for requests admitted before r may have evicted its old match
        matched, borrow = len(r.prefix_slots), None
        if sim is not None and sim.total_size:
            # only what r could take from the cache counts: positions whose logits r needs are recomputed anyway
            limit = match_limit(s, r)
            codes = sim.match(r.fill_ids[:limit])[0] if limit else torch.empty(0, dtype=torch.int64)
            shared = len(codes)
            fused = r.parent is not None and r.parent.chain.latency_fused  # (a select's latency fusion)
            if shared - matched >= IN_BATCH_DEPRIORITIZE and not fused:
                lend = _lender(lenders, codes, matched)
                if lend is None or r.seq_len - shared > add.rem_chunk:
                    continue  # a request in this batch (or the forward in flight) computes it: share it next step
                borrow = (*lend, shared)  # the forward in flight computes it: borrow its slots
        ext = r.seq_len - (matched if borrow is None else borrow[-1])
        chunk = ext > add.rem_chunk
        if chunk and s.chunked is not None:
            if add.shaped:
                continue  # one chunked request at a time; shorter prompts behind r may still fit
            break  # one chunked request at a time
        ext = min(ext, add.rem_chunk)
        if not add.try_admit(r, ext, chunk, borrow):
            break
        if chunk:
            s.chunked = r
        admitted.add(r)
        if sim is not None:
            _simulate(sim, r.fill_ids)
        add.take(r, ext)
    if admitted:
        s.waiting = [r for r in s.waiting if r not in admitted]


def _continue_chunked(s: "Scheduler", add: PrefillAdder) -> None:
    """The chunked request's next chunk, as much of it as the budgets and the KV room take."""
    r = s.chunked
    ext = min(len(r.fill_ids) - r.kv_len, add.rem_chunk, s.memory.room)
    if ext > 0:
        add.take(r, ext)
        if r.kv_len == len(r.fill_ids):
            s.chunked = None
