"""Decode: one step for every running request, retracting requests when the KV pool runs short.

Each running request needs one slot. If free + evictable slots do not cover them, the least-progressed request
(fewest outputs; longest prompt first among equals: least work lost) is retracted: its computed KV goes into the
radix tree, it returns to the head of the queue, and later resumes from whatever part of its KV is still cached,
with the same result. A lone running request that does not fit is aborted, unless chains between two calls
(`Scheduler.continuing`, resident with their KV) hold memory: they go back to the queue first, the latest first.
`new_token_ratio` (admission's estimate of how much of their budget running requests will use) resets after a
retraction and decays while memory holds.

With overlap, a request whose last token is still on the device and will end it for sure (its max_new_tokens, or
the context length) is left out of the step: its end is known before its token is.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..core import Req
from ..runner import ScheduledBatch, decode_batch

if TYPE_CHECKING:
    from .scheduler import Scheduler


def will_finish(r: Req, context_length: int) -> bool:
    """r's token still on the device (kv_len == len(fill_ids)) is its last, whatever it is."""
    return r.kv_len == r.seq_len and (len(r.output_ids) + 1 >= r.params.max_new_tokens
                                      or r.seq_len + 1 >= context_length)


def schedule_decode(s: "Scheduler") -> ScheduledBatch | None:
    if not s.running:
        return None
    mem, cfg = s.memory, s.cfg
    retracted = False
    while True:
        reqs = [r for r in s.running if not will_finish(r, s.context_length)]
        mem.evict(len(reqs) - mem.slots.available)
        if mem.slots.available >= len(reqs):
            break
        if len(s.running) == 1 and s.continuing:
            requeue(s, s.continuing[-1])  # a chain between two calls holds KV too: it goes back, not r
            s.stats["retractions"] += 1
            retracted = True
            continue
        if len(s.running) == 1:
            r = s.running[0]
            s.out.append(r)
            s.finish(r, {"type": "abort", "message": "out of KV cache memory: the request does not fit the KV pool "
                                                     "(raise max_total_tokens)"})
            return None
        s._retract()
        retracted = True
    if retracted:
        done = sum(len(r.output_ids) for r in s.running)
        total = sum(r.params.max_new_tokens for r in s.running) or 1
        s.new_token_ratio = min(1.0, (done + cfg.retract_reserve_steps * len(s.running)) / total)
    else:
        decay = (cfg.init_new_token_ratio - cfg.min_new_token_ratio) / cfg.new_token_ratio_decay_steps
        s.new_token_ratio = max(s.new_token_ratio - decay, cfg.min_new_token_ratio)
    if not reqs:
        return None
    positions, slots = mem.extend_each(reqs)
    return decode_batch(reqs, positions, slots, mem.take_pending(), mem.shared_prefix(reqs))


def retract(s: "Scheduler") -> Req:
    """Send the least-progressed running request back to the head of the queue (module docstring)."""
    victim = min(s.running, key=lambda r: (len(r.output_ids), -len(r.input_ids)))
    requeue(s, victim)
    s.stats["retractions"] += 1
    return victim


def requeue(s: "Scheduler", r: Req) -> None:
    """Send resident r (running, or a chain between two calls) back to the head of the queue: it gives up its KV
    (its computed part goes to the tree) and is matched and admitted again."""
    for q in (s.running, s.continuing):
        if r in q:
            q.remove(r)
    s.memory.release(r)
    r.match_version = -1  # its token sequence may have grown since it last waited
    s.waiting.insert(0, r)
