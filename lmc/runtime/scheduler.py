"""Scheduler: continuous batching over the radix cache (SGLang's policies, one forward per `step()`).

Each step runs a prefill batch if any request can be admitted (prefill first), else one decode step for every
running request. Admission orders the waiting queue by the policy (`lpm` by default, kept on under any load:
matching is a few C-level slice compares per tree edge), skips requests whose prefix another request in the same
batch is about to compute (in-batch prefix dedup), and stops at a budget: free + evictable KV slots minus what the
running requests are expected to still need (`new_token_ratio` x their remaining tokens, a ratio that decays while
memory holds and resets after a retraction). At most one request is prefilled in chunks at a time. When decode
runs out of KV, the least-progressed request is retracted: its KV goes into the radix tree, it returns to the
queue, and later resumes from whatever part of its KV is still cached, with the same result.

Jump-forward (constrained requests, SGLang's compressed-FSM decoding): after a constrained request accepts a
token, a string its grammar forces is appended without sampling (`_jump_forward`). The output is retokenized over a
suffix window so its ids stay the canonical encoding of its text, the matcher is rolled back to the first changed
token, and the request leaves the batch: its KV up to the first changed token goes into the radix tree, the rest is
freed, and it is re-queued, so its next prefill matches the unchanged prefix and computes only the new tokens (the
"KV rollback" costs nothing). A grammar that is complete and allows only a stop token gets it appended too.

Slot accounting invariant (checked by `check_invariants()` after every step in tests): every KV slot is exactly
one of free, owned by the radix tree (evictable or protected), or owned by a resident request (row positions
`[cache_protected_len, kv_len)`).

Failure isolation: a forward that raises is retried on halves of its batch (bisection) until the requests it fails
for are singled out; those alone finish with an error (`Req.error`), the rest of the batch is processed as
usual. A forward writes KV only into the slots allocated for its batch, and slots past a request's
`kv_len` belong to no one in the invariant above, so a failed forward leaves the pools and the tree consistent: a
blamed request's step slots are freed and its earlier KV goes to the tree like an aborted request's. An error while
processing one request's output fails that request alone. Only an error in scheduling itself, or a device fault
(a CUDA error poisons everything computed since), leaves memory untrusted: then the engine calls `recover()`.
"""
from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass

import torch

from .core import Req
from .radix_cache import RadixCache
from .runner import ModelRunner, ScheduledBatch, StepOutput

CLIP_NEW_TOKENS = 4096  # cap on the per-request output estimate used by admission (SGLang's constant)
IN_BATCH_CHECK = 32  # requests matching at most this many cached tokens are checked against the batch...
IN_BATCH_DEPRIORITIZE = 32  # ...and wait a step if a request admitted earlier carries >= this many of their tokens
POLICIES = ("lpm", "dfs-weight", "fcfs", "random")
MIX_MAX_EXTEND = 64  # running requests decode inside a prefill of jump-forward extends at most this long

log = logging.getLogger(__name__)


@dataclass
class SchedulerConfig:
    policy: str = "lpm"
    max_running: int = 256
    max_prefill_tokens: int = 16384
    chunked_prefill_size: int = 8192
    init_new_token_ratio: float = 0.7
    min_new_token_ratio: float = 0.098
    new_token_ratio_decay_steps: int = 600
    retract_reserve_steps: int = 20
    # Ablation knob (benchmarks only, the paper's Figure 8): the share of requests, drawn by the scheduler's seeded
    # RNG when they arrive, whose cached prefix is ignored, so the hit rate drops while everything else is unchanged.
    match_drop_rate: float = 0.0


class Scheduler:
    def __init__(self, runner: ModelRunner, cfg: SchedulerConfig, *, disable_radix_cache: bool = False,
                 tokenizer=None, seed: int = 0, grammars=None, enable_jump_forward: bool = True,
                 debug_checks: bool = False):
        """`grammars`: the engine's GrammarCache (jump-forward needs its tokenizer tables). `debug_checks`: assert,
        after every jump, that the output ids are the tokenizer's canonical encoding of the output text."""
        if cfg.policy not in POLICIES:
            raise ValueError(f"unknown schedule policy {cfg.policy!r}; choose one of {POLICIES}")
        self.runner, self.cfg, self.tokenizer = runner, cfg, tokenizer
        self.table = runner.req_pool.table
        self.disable_radix_cache = disable_radix_cache
        self.grammars, self.enable_jump_forward, self.debug_checks = grammars, enable_jump_forward, debug_checks
        self._rng = random.Random(seed)
        self.reset()
        self.stats = {"forwards": 0, "prefill_forwards": 0, "decode_forwards": 0, "prompt_tokens": 0,
                      "cached_tokens": 0, "computed_tokens": 0, "retractions": 0, "cache_seconds": 0.0,
                      "mixed_forwards": 0, "jumps": 0, "jump_forward_tokens": 0, "retokenized_tokens": 0,
                      "jump_seconds": 0.0, "canonical_checks": 0, "aborted": 0, "failed_forwards": 0,
                      "failed_requests": 0, "recoveries": 0}

    def reset(self) -> None:
        """Forget every request and cached prefix and rebuild the pools. The queues are emptied first: should
        the device refuse the rebuild, the scheduler is at least left with no work."""
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked: Req | None = None
        self._early: list[Req] = []  # finished before their first forward (their whole output was forced)
        self._no_match: set[Req] = set()  # requests whose cached prefix is ignored (match_drop_rate)
        self.new_token_ratio = self.cfg.init_new_token_ratio
        self.runner.reset_memory()
        self.allocator = self.runner.allocator
        self.cache = RadixCache(self.allocator.free, disabled=self.disable_radix_cache)

    def recover(self) -> list[Req]:
        """After an error no request could be blamed for (in scheduling itself, or a device fault): the pools and
        the tree are not trusted, so they are rebuilt (the prefix cache is lost). Queued requests hold no KV and
        stay queued (their matches are forgotten; one being admitted when the error struck loses its row with the
        pools); resident ones lose their KV and are dropped. Returns the requests still queued."""
        kept = [r for r in self.waiting if not r.finished]
        self.reset()
        for r in kept:
            r.row, r.kv_len, r.cache_protected_len, r.last_node = -1, 0, 0, None
            r.prefix_slots, r.match_node, r.match_version = None, None, -1
        self.waiting = kept
        self.stats["recoveries"] += 1
        return kept

    # ---- front ---------------------------------------------------------------------------------------------
    def add(self, req: Req) -> None:
        try:
            if req.grammar is not None and req.params.max_new_tokens > 0 and self._jump_forward(req) == "finished":
                self._early.append(req)  # the grammar forced the whole output: no forward needed
                return
        except Exception as e:  # it holds no KV yet: it fails alone, delivered by the next step
            if _device_fault(e):
                raise
            self._fail(req, e)
            self._early.append(req)
            return
        if self.cfg.match_drop_rate and self._rng.random() < self.cfg.match_drop_rate:
            self._no_match.add(req)
        self.waiting.append(req)

    @property
    def shares_prefixes_in_batch(self) -> bool:
        """Whether a prefix several queued requests share is computed once (in-batch dedup, LPM policies)."""
        return self.cfg.policy in ("lpm", "dfs-weight") and not self.cache.disabled

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked or self._early)

    def abort(self, rid) -> Req | None:
        """Finish request `rid` now with an abort reason, wherever it is: queued (never admitted, retracted or
        re-queued by a jump: it holds no KV), running, or in the middle of a chunked prefill. A resident request's
        KV goes to the radix tree like a finished request's (its computed prefix stays reusable). Returns the
        request, or None when no unfinished request has that id (it finished already: nothing to do)."""
        places = {"waiting": self.waiting, "running": self.running,
                  "in a chunked prefill": [self.chunked] if self.chunked is not None else []}
        hit = next(((where, r) for where, reqs in places.items() for r in reqs if str(r.rid) == str(rid)), None)
        if hit is None:
            return None
        where, r = hit
        if r is self.chunked:
            self.chunked = None
        if r in self.waiting:
            self.waiting.remove(r)
        self._finish(r, {"type": "abort", "message": f"aborted while {where}"})
        self.stats["aborted"] += 1
        return r

    def flush_cache(self) -> bool:
        """Drop every cached prefix. Only when idle (as SGLang): cached slots may be in use otherwise."""
        if self.has_work:
            return False
        self.cache.evict(self.cache.total_size)
        self.cache.reset()
        return True

    def step(self) -> list[Req]:
        """Run one forward. Returns the requests that produced output in it (finished ones have `.finished`).
        A request failed by a fault in the step is among them, finished with `.error` set."""
        self._aborted: list[Req] = self._early
        self._early = []
        self._riders: set[Req] = set()  # running requests decoding inside this step's prefill forward
        sb = self._schedule_prefill() or self._schedule_decode()
        if sb is None:
            return self._aborted
        return self._aborted + self._run(sb)

    def _run(self, sb: ScheduledBatch) -> list[Req]:
        """Forward `sb` and process its output. If the forward raises, bisect: run each half on its own, down to
        the single requests it fails for, which fail alone (see the module docstring)."""
        try:
            out = self.runner.run(sb)
        except Exception as e:
            if _device_fault(e):
                raise
            self.stats["failed_forwards"] += 1
            if len(sb.reqs) == 1:
                self._fail(sb.reqs[0], e, step_slots=sb.extend_lens[0])
                return sb.reqs
            half = len(sb.reqs) // 2
            return self._run(_sub_batch(sb, 0, half)) + self._run(_sub_batch(sb, half, len(sb.reqs)))
        self.stats["forwards"] += 1
        self.stats["decode_forwards" if sb.is_decode else "prefill_forwards"] += 1
        return self._process(sb, out)

    def _fail(self, r: Req, exc: BaseException, step_slots: int = 0) -> None:
        """Finish `r` with an error: a fault in this step was blamed on it. `step_slots`: slots allocated for r in
        this step past its kv_len that its failed forward never filled (freed). Its earlier KV is sound and goes
        to the tree, as an aborted request's does."""
        if r.row >= 0 and step_slots:
            self.allocator.free(self.table[r.row, r.kv_len:r.kv_len + step_slots].to("cpu", torch.int64))
        if r is self.chunked:
            self.chunked = None
        for q in (self.running, self.waiting):
            if r in q:
                q.remove(r)
        self._release(r)
        r.finished, r.error = True, f"{type(exc).__name__}: {exc}"
        r.finish_reason = {"type": "abort", "message": f"internal error: {r.error}"}
        self.stats["failed_requests"] += 1
        log.error("request %s failed inside a step; the other requests carry on", r.rid, exc_info=exc)

    # ---- prefill -------------------------------------------------------------------------------------------
    def _schedule_prefill(self) -> ScheduledBatch | None:
        if self.chunked is None and not self.waiting:
            return None
        if self.chunked is None and (len(self.running) >= self.cfg.max_running or not self.runner.req_pool.available):
            return None  # nothing could be admitted: skip matching the queue
        t0 = time.perf_counter()
        for r in self.waiting:
            self._match(r)
        order = self._order()
        self.stats["cache_seconds"] += time.perf_counter() - t0
        reqs, prefix_lens, extend_lens, slots = [], [], [], []
        rem_input, rem_chunk = self.cfg.max_prefill_tokens, self.cfg.chunked_prefill_size
        reserved = sum(self._est_new(r) for r in self.running) * self.new_token_ratio

        def take(r: Req, ext: int) -> None:
            nonlocal rem_input, rem_chunk, reserved
            reqs.append(r)
            prefix_lens.append(r.kv_len)
            extend_lens.append(ext)
            slots.append(self._alloc_into(r, ext))
            rem_input -= ext
            rem_chunk -= ext
            if r.kv_len + ext == len(r.fill_ids):
                reserved += self._est_new(r)

        if self.chunked is not None:  # the in-flight chunked request continues first
            r = self.chunked
            ext = min(len(r.fill_ids) - r.kv_len, rem_chunk, self.allocator.available + self.cache.evictable_size)
            if ext > 0:
                take(r, ext)
        sim = RadixCache() if self.shares_prefixes_in_batch else None
        admitted: set[Req] = set()
        for r in order:
            if len(self.running) + len(reqs) >= self.cfg.max_running or self.runner.req_pool.available == 0:
                break
            if rem_chunk <= 0 or (reqs and rem_input <= 0):
                break
            self._match(r)  # again: allocations for requests admitted before r may have evicted its old match
            matched = len(r.prefix_slots)
            if sim is not None and matched <= IN_BATCH_CHECK:
                in_batch, _ = sim.match(r.fill_ids)
                if reqs and len(in_batch) >= IN_BATCH_DEPRIORITIZE:
                    continue  # a request in this batch computes this prefix; share it next step
            ext = len(r.fill_ids) - matched
            chunk = ext > rem_chunk
            if chunk and self.chunked is not None:
                break  # one chunked request at a time
            ext = min(ext, rem_chunk)
            if not self._make_resident(r, ext, 0 if chunk else self._est_new(r), reserved,
                                       idle=not reqs and not self.running):
                break
            if chunk:
                self.chunked = r
            admitted.add(r)
            if sim is not None:
                sim.insert(r.fill_ids, torch.zeros(len(r.fill_ids), dtype=torch.int64))
            take(r, ext)
        if admitted:
            self.waiting = [r for r in self.waiting if r not in admitted]
        if not reqs:
            return None
        if (self.running and self.chunked is None and max(extend_lens) <= MIX_MAX_EXTEND
                and all(r.jumps and r.computed_tokens for r in reqs)
                and self.allocator.available + self.cache.evictable_size >= len(self.running)):
            # Only short jump-forward extends to prefill: the running requests decode in the same forward (as
            # 1-token extends), so a jump costs its request no extra forward and the others no stall.
            self._riders = set(self.running)
            for r in self.running:
                reqs.append(r)
                prefix_lens.append(r.kv_len)
                extend_lens.append(1)
                slots.append(self._alloc_into(r, 1))
            self.stats["mixed_forwards"] += 1
        return ScheduledBatch(reqs, False, prefix_lens, extend_lens, torch.cat(slots),
                              [p + e == len(r.fill_ids) and r.params.max_new_tokens > 0
                               for r, p, e in zip(reqs, prefix_lens, extend_lens)])

    def _est_new(self, r: Req) -> int:
        return min(r.params.max_new_tokens - len(r.output_ids), CLIP_NEW_TOKENS)

    def _match(self, r: Req) -> None:
        """Longest cached prefix usable by `r`: at least one token is always recomputed (its logits are needed),
        and the positions of prompt logprobs not recorded yet are recomputed too."""
        if r.match_version == self.cache.version:
            return  # nothing was inserted or evicted since: the match still holds (LPM stays cheap under load)
        limit = len(r.fill_ids) - 1
        if r.next_prompt_logprob < len(r.input_ids):
            limit = min(limit, max(r.next_prompt_logprob - 1, 0))
        if r in self._no_match and r.computed_tokens == 0:
            limit = 0  # ablation: compute the whole prompt (the empty key matches the root)
        r.prefix_slots, r.match_node = self.cache.match(r.fill_ids[:limit])
        r.match_version = self.cache.version

    def _make_resident(self, r: Req, ext: int, est_new: int, reserved: float, idle: bool) -> bool:
        """Give `r` a row and lock its cached prefix if its `ext` new tokens plus `est_new` expected outputs fit
        the budget. On an idle engine the first request only needs its tokens to fit at all."""
        self.cache.lock(r.match_node)
        room = self.allocator.available + self.cache.evictable_size
        if (idle and ext <= room) or ext + est_new <= room - reserved:
            row = self.runner.req_pool.alloc()
            if row is not None:
                p = len(r.prefix_slots)
                self.table[row, :p] = r.prefix_slots.to(self.table.device, torch.int32)
                r.row, r.last_node, r.cache_protected_len, r.kv_len = row, r.match_node, p, p
                # Prompt tokens served from the cache that r did not compute itself earlier. Output tokens found
                # in the cache (after a jump-forward, another request may have cached the same forced text) are
                # no prompt cache hit: cached_tokens <= prompt_tokens.
                fresh = max(0, min(p, len(r.input_ids)) - r.computed_tokens)
                r.cached_tokens += fresh
                self.stats["cached_tokens"] += fresh
                self.stats["prompt_tokens"] += len(r.input_ids) if r.computed_tokens == 0 else 0
                return True
        self.cache.unlock(r.match_node)
        return False

    def _alloc_into(self, r: Req, n: int) -> torch.Tensor:
        """Allocate n slots (evicting cached prefixes if needed) for r's next n positions."""
        slots = self.allocator.alloc(n)
        if slots is None:
            t0 = time.perf_counter()
            self.cache.evict(n - self.allocator.available)
            self.stats["cache_seconds"] += time.perf_counter() - t0
            slots = self.allocator.alloc(n)
        assert slots is not None, "admission budget admitted more than fits"
        self.table[r.row, r.kv_len:r.kv_len + n] = slots.to(self.table.device, torch.int32)
        return slots

    def _order(self) -> list[Req]:
        policy, q = self.cfg.policy, self.waiting
        if self.cache.disabled or policy == "fcfs":
            return list(q)
        if policy == "random":
            q = list(q)
            self._rng.shuffle(q)
            return q
        if policy == "lpm":
            return sorted(q, key=lambda r: -len(r.prefix_slots))
        # dfs-weight: visit the tree heaviest subtree first, so requests sharing a subtree stay adjacent.
        at_node: dict = {}
        for r in q:
            at_node.setdefault(r.match_node, []).append(r)
        weight: dict = {}
        for node, rs in at_node.items():
            while node is not None:
                weight[node] = weight.get(node, 0) + len(rs)
                node = node.parent
        out: list[Req] = []
        stack = [(self.cache.root, False)]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                out.extend(at_node.get(node, ()))
                continue
            stack.append((node, True))
            kids = sorted((c for c in node.children.values() if c in weight), key=lambda c: weight[c])
            stack.extend((c, False) for c in kids)  # heaviest pushed last, visited first
        return out

    # ---- decode --------------------------------------------------------------------------------------------
    def _schedule_decode(self) -> ScheduledBatch | None:
        if not self.running:
            return None
        short = len(self.running) - self.allocator.available
        if short > 0:
            t0 = time.perf_counter()
            self.cache.evict(short)
            self.stats["cache_seconds"] += time.perf_counter() - t0
        retracted = False
        while self.allocator.available < len(self.running):
            if len(self.running) == 1:
                self._aborted.append(self.running[0])
                self._finish(self.running[0], {"type": "abort", "message": "out of KV cache memory: the request "
                             "does not fit the KV pool (raise max_total_tokens)"})
                return None
            self._retract()
            retracted = True
        if retracted:
            done = sum(len(r.output_ids) for r in self.running)
            total = sum(r.params.max_new_tokens for r in self.running) or 1
            self.new_token_ratio = min(1.0, (done + self.cfg.retract_reserve_steps * len(self.running)) / total)
        else:
            decay = (self.cfg.init_new_token_ratio - self.cfg.min_new_token_ratio) / self.cfg.new_token_ratio_decay_steps
            self.new_token_ratio = max(self.new_token_ratio - decay, self.cfg.min_new_token_ratio)
        reqs = list(self.running)
        slots = self.allocator.alloc(len(reqs))  # enough is free: ensured above
        dev = self.table.device
        rows = torch.tensor([r.row for r in reqs], device=dev)
        self.table[rows, torch.tensor([r.kv_len for r in reqs], device=dev)] = slots.to(dev, torch.int32)
        return ScheduledBatch(reqs, True, [r.kv_len for r in reqs], [1] * len(reqs), slots, [True] * len(reqs))

    def _retract(self) -> None:
        """Send the least-progressed request back to the queue (fewest outputs; longest prompt first among
        equals): least work lost. Its KV is kept in the tree, so resuming recomputes only what was evicted."""
        victim = min(self.running, key=lambda r: (len(r.output_ids), -len(r.input_ids)))
        self.running.remove(victim)
        self._release(victim)
        victim.match_version = -1  # its token sequence grew since it last waited
        self.waiting.insert(0, victim)
        self.stats["retractions"] += 1
        short = len(self.running) - self.allocator.available
        if short > 0:
            self.cache.evict(short)

    # ---- after the forward ---------------------------------------------------------------------------------
    def _process(self, sb: ScheduledBatch, out: StepOutput) -> list[Req]:
        for r, ext in zip(sb.reqs, sb.extend_lens):  # the forward filled these slots: r owns them now
            r.kv_len += ext
            r.computed_tokens = max(r.computed_tokens, r.kv_len)
            r.forward_passes += 1
            self.stats["computed_tokens"] += ext
        progressed = []
        for r, nid, olp, ilp in zip(sb.reqs, out.next_ids, out.out_logprobs, out.in_logprobs):
            try:
                if self._process_one(r, nid, olp, ilp, sb.is_decode):
                    progressed.append(r)
            except Exception as e:  # this request's output broke something: it fails alone
                if _device_fault(e):
                    raise
                self._fail(r, e)
                progressed.append(r)
        return progressed

    def _process_one(self, r: Req, nid: int | None, olp, ilp, is_decode: bool) -> bool:
        """Fold one request's forward output in. Returns whether it produced output (a token, or its end)."""
        if r.params.return_logprob:
            # A resumed prefill (after a retraction, or a jump whose prompt KV was evicted) recomputes prompt
            # positions already recorded: each prompt logprob is recorded once, in position order.
            if r.logprob_start == 0 and not r.input_logprobs:
                r.input_logprobs.append((None, r.input_ids[0], None))
                r.input_top_logprobs.append(None)
            for pos, lp, top in ilp:
                if pos == r.next_prompt_logprob:
                    r.input_logprobs.append((lp, r.input_ids[pos], None))
                    r.input_top_logprobs.append(top)
        if nid is None:
            if r.kv_len < len(r.fill_ids):  # a non-final chunk: share what it has so far
                self._cache_unfinished(r)
                return False
            if r is self.chunked:  # max_new_tokens == 0: prefill only
                self.chunked = None
            self._finish(r, {"type": "length", "length": 0})
            return True
        if r is self.chunked:
            self.chunked = None
        r.output_ids.append(nid)
        if olp is not None:
            r.output_logprobs.append((olp[0], nid, None))
            r.output_top_logprobs.append(olp[1])
            if olp[2] is not None:
                r.output_token_ids_logprobs.append([(lp, t, None) for lp, t in olp[2]])
        if r.grammar is not None and not r.grammar.accept_token(nid):  # the mask allowed it: cannot happen
            reason = {"type": "abort", "message": f"token {nid} was sampled but its grammar rejects it"}
        else:
            reason = self._finish_reason(r, nid)
        if reason is None and r.grammar is not None:
            jumped = self._jump_forward(r)
            if jumped is not None:  # r left the batch: finished, or re-queued to prefill the forced tokens
                if jumped == "requeue":
                    self.waiting.insert(0, r)
                return True
        if reason is not None:
            self._finish(r, reason)
        elif not is_decode and r not in self._riders:
            self._cache_unfinished(r)
            self.running.append(r)
        return True

    def _finish_reason(self, r: Req, tok: int) -> dict | None:
        p, n = r.params, len(r.output_ids)
        if r.grammar is not None and r.grammar.is_terminated():  # it accepted a stop token: nothing may follow
            return {"type": "stop", "matched": tok}
        if n >= p.min_new_tokens:
            if p.stop_token_ids and tok in p.stop_token_ids:
                return {"type": "stop", "matched": tok}
            if not p.ignore_eos and tok in self.runner.cfg.eos_token_ids:
                return {"type": "stop", "matched": tok}
            if p.stop and self.tokenizer is not None:
                window = max(len(s) for s in p.stop) + 2  # tokens: each covers at least one character
                tail = self.tokenizer.decode(r.output_ids[-window:], skip_special_tokens=True)
                hit = [s for s in p.stop if s in tail]
                if hit:
                    return {"type": "stop", "matched": hit[0]}
        if n >= p.max_new_tokens:
            return {"type": "length", "length": p.max_new_tokens}
        if r.seq_len >= self.runner.context_length:
            return {"type": "length", "length": n}
        return None

    # ---- jump-forward --------------------------------------------------------------------------------------
    def _jump_helper(self):
        if not self.enable_jump_forward or self.grammars is None or self.tokenizer is None:
            return None
        return self.grammars.jump_forward()

    def _jump_forward(self, r: Req) -> str | None:
        """Append what r's grammar forces now. Returns None (nothing forced: r carries on), "finished", or
        "requeue": r is no longer resident and the caller queues it; its next prefill re-matches the unchanged
        prefix in the radix tree and computes the new tokens (and samples the next one)."""
        jf = self._jump_helper()
        if jf is None:
            return None
        t0 = time.perf_counter()
        out, m = r.output_ids, r.grammar
        got = jf.jump(m, out, r.canonical_len)
        k, new_out = got if got is not None else (len(out), list(out))
        stop = jf.forced_stop(m)
        if got is None and stop is None:
            self.stats["jump_seconds"] += time.perf_counter() - t0
            return None
        if stop is not None:
            m.accept_token(stop)
            if got is None and r.canonical_len < len(out):  # tokens sampled since the last jump: canonicalize
                rt = jf.retokenize(out, "", r.canonical_len)  # them too (free: r finishes, no KV is redone)
                if rt is not None:
                    new_out = out[:rt[0]] + rt[1]
                    k = rt[0]
                    while k < min(len(out), len(new_out)) and out[k] == new_out[k]:
                        k += 1
            new_out.append(stop)
        # KV: keep the positions before the first changed token; the tree takes them, the rest is freed.
        if r.row >= 0:
            self._truncate_kv(r, min(r.kv_len, len(r.input_ids) + k))
            if r in self.running:
                self.running.remove(r)
            self._release(r)
        r.computed_tokens = min(r.computed_tokens, len(r.input_ids) + k)
        r.match_version = -1
        added = len(new_out) - k
        r.jumps += 1
        r.jump_forward_tokens += added
        r.retokenized_tokens += len(out) - k
        self.stats["jumps"] += 1
        self.stats["jump_forward_tokens"] += added
        self.stats["retokenized_tokens"] += len(out) - k
        if r.params.return_logprob:  # forced tokens were not sampled: they carry no logprob
            del r.output_logprobs[k:], r.output_top_logprobs[k:]
            r.output_logprobs.extend((None, t, None) for t in new_out[k:])
            r.output_top_logprobs.extend([None] * added)
            if r.params.token_ids_logprob is not None:
                del r.output_token_ids_logprobs[k:]
                r.output_token_ids_logprobs.extend([None] * added)
        r.output_ids = new_out
        r.canonical_len = len(new_out) - (stop is not None)
        reason = self._jump_finish_reason(r, added, stop)
        if self.debug_checks and (reason is None or reason["type"] == "stop"):
            self._check_canonical(r, stop)
        self.stats["jump_seconds"] += time.perf_counter() - t0
        if reason is not None:
            self._finish(r, reason)
            return "finished"
        return "requeue"

    def _jump_finish_reason(self, r: Req, added: int, stop: int | None) -> dict | None:
        p, n = r.params, len(r.output_ids)
        limit = min(p.max_new_tokens, self.runner.context_length - len(r.input_ids))
        if n > limit:  # the forced tokens overshoot the budget: cut them there
            del r.output_ids[limit:]
            del r.output_logprobs[limit:], r.output_top_logprobs[limit:]
            if stop is not None and r.output_ids[-1:] != [stop]:
                stop = None
        if stop is not None:
            return {"type": "stop", "matched": stop}
        if p.stop and self.tokenizer is not None and len(r.output_ids) >= p.min_new_tokens:
            window = max(len(s) for s in p.stop) + 2 + added
            tail = self.tokenizer.decode(r.output_ids[-window:], skip_special_tokens=True)
            hit = [s for s in p.stop if s in tail]
            if hit:
                return {"type": "stop", "matched": hit[0]}
        if len(r.output_ids) >= limit:
            return {"type": "length", "length": len(r.output_ids)}
        return None

    def _check_canonical(self, r: Req, stop: int | None) -> None:
        ids = r.output_ids[:-1] if stop is not None else r.output_ids
        text = self.tokenizer.decode(ids)
        canonical = self.tokenizer.encode(text, add_special_tokens=False)
        assert ids == canonical, (f"after a jump the output ids are not the canonical encoding of {text!r}: "
                                  f"{ids} != {canonical}")
        self.stats["canonical_checks"] += 1

    def _truncate_kv(self, r: Req, keep: int) -> None:
        """Drop r's KV past `keep` positions: free the slots r owns there (the tree's stay in the tree)."""
        if keep < r.kv_len:
            lo = max(keep, r.cache_protected_len)
            if lo < r.kv_len:
                self.allocator.free(self.table[r.row, lo:r.kv_len].to("cpu", torch.int64))
            r.kv_len = keep

    def _finish(self, r: Req, reason: dict) -> None:
        r.finished, r.finish_reason = True, reason
        self._no_match.discard(r)
        if r in self.running:
            self.running.remove(r)
        self._release(r)
        if self.tokenizer is not None:
            text = self.tokenizer.decode(r.output_ids, skip_special_tokens=True)
            if reason.get("type") == "stop" and isinstance(reason.get("matched"), str):
                text = text[:text.find(reason["matched"])]
            r.text = text

    # ---- radix-cache hooks ---------------------------------------------------------------------------------
    def _release(self, r: Req) -> None:
        """Hand r's KV to the tree (duplicates of what the tree already holds are freed), unlock, free the row."""
        if r.row < 0:
            return
        t0 = time.perf_counter()
        slots = self.table[r.row, :r.kv_len].to("cpu", torch.int64)
        if self.cache.disabled:
            self.allocator.free(slots)
        else:
            already = self.cache.insert(r.fill_ids[:r.kv_len], slots)
            self.allocator.free(slots[r.cache_protected_len:already])
            self.cache.unlock(r.last_node)
        self.runner.req_pool.free(r.row)
        r.row, r.kv_len, r.cache_protected_len, r.last_node = -1, 0, 0, None
        self.stats["cache_seconds"] += time.perf_counter() - t0

    def _cache_unfinished(self, r: Req) -> None:
        """Insert r's computed tokens into the tree while it keeps running (so requests queued behind it can
        share them), adopt the tree's slots for positions it already held, and move r's lock to the new node."""
        if self.cache.disabled:
            return
        t0 = time.perf_counter()
        key = r.fill_ids[:r.kv_len]
        slots = self.table[r.row, :r.kv_len].to("cpu", torch.int64)
        already = self.cache.insert(key, slots)
        protected = r.cache_protected_len
        if already > protected:
            self.allocator.free(slots[protected:already])
        canonical, node = self.cache.match(key)
        if already > protected:
            self.table[r.row, protected:already] = canonical[protected:already].to(self.table.device, torch.int32)
        self.cache.lock(node)
        self.cache.unlock(r.last_node)
        r.last_node, r.cache_protected_len = node, r.kv_len
        self.stats["cache_seconds"] += time.perf_counter() - t0

    # ---- invariants ----------------------------------------------------------------------------------------
    def resident(self) -> list[Req]:
        extra = [self.chunked] if self.chunked is not None and self.chunked not in self.running else []
        return self.running + extra

    def check_invariants(self) -> None:
        """Every slot is exactly one of: free, in the tree, owned by a resident request."""
        self.cache.check()
        owned = [self.table[r.row, r.cache_protected_len:r.kv_len].to("cpu", torch.int64) for r in self.resident()]
        free = self.allocator.free_slots()
        parts = [free, self.cache.slots(), *owned]
        every = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
        total = self.allocator.num_slots
        assert len(free) + self.cache.total_size + sum(map(len, owned)) == total, "slot accounting drifted"
        assert len(every) == total and torch.equal(every.sort().values, torch.arange(1, total + 1)), \
            "a slot is lost or owned twice"
        for r in self.resident():
            assert r.row >= 0 and r.last_node is not None
            if not self.cache.disabled:
                tree_slots = self.cache.peek(r.fill_ids[:r.cache_protected_len])
                row = self.table[r.row, :r.cache_protected_len].to("cpu", torch.int64)
                assert torch.equal(tree_slots, row), "a request's shared prefix disagrees with the tree"


def _sub_batch(sb: ScheduledBatch, lo: int, hi: int) -> ScheduledBatch:
    """Requests lo..hi of a scheduled batch, with their slots (out_slots holds each request's extend in order)."""
    start, end = sum(sb.extend_lens[:lo]), sum(sb.extend_lens[:hi])
    return ScheduledBatch(sb.reqs[lo:hi], sb.is_decode, sb.prefix_lens[lo:hi], sb.extend_lens[lo:hi],
                          sb.out_slots[start:end], sb.sample[lo:hi])


def _device_fault(e: BaseException) -> bool:
    """A CUDA error (illegal address, device-side assert) poisons the context: nothing computed since, KV
    included, can be trusted, so no retry can isolate it. Out-of-memory is no such fault (a smaller batch fits)."""
    accel = getattr(torch, "AcceleratorError", None)
    return (accel is not None and isinstance(e, accel)) or "CUDA error" in str(e)
