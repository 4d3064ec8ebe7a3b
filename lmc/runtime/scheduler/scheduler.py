"""Scheduler: continuous batching over the radix cache (SGLang's policies), one forward launched per `step()`.

Each step schedules a prefill batch if any request can be admitted (prefill first, prefill.py), else one decode
step for every running request (decode.py), and launches it on the runner. The memory it schedules from is the
CacheManager's (cache.py: rows, slots, the radix tree, the host copy of the slot table).

Overlap (`overlap=True`, mini-sglang's scheme): the step launches batch N+1 before it processes batch N, so that
the host's work on N (detokenizing, stop checks, finishing, radix inserts, jump-forward) runs while the device
computes N+1. This works because N+1 never needs N's tokens on the host: a decode step reads its input ids from
the runner's token buffer on the device, where N's sampling wrote them, and slots are allocated from the host's
own accounting. Sampling N+1 is queued only after N is processed, so a grammar's mask (and penalties, seeds,
min-tokens bans) see N's token: constrained requests keep overlapping with the rest. Scheduling N+1 before N's
tokens are known costs little: a request that N ends is also in N+1, where it computes one wasted position; when
N ends it (finish, abort, jump, retraction) it gives up its KV and starts a new epoch, and its N+1 entry, stale,
is dropped (`Req.epoch`). Without overlap each step launches, samples and processes one batch, in that order.
Either way the outputs are the same: greedy decoding is a function of the tokens, which do not depend on when the
host learns them.

Chains (continuation.py): a chain request whose call ends goes on to its next call instead of finishing
(`finish`): it waits in `continuing`, resident with its KV, until its next prefill chunk is scheduled (before the
queue, without admission or match), or in `parked` while the child requests scoring its select's choices run,
or in `forking` (its KV in the tree, no row of its own) while its fork's branches run as child requests.

Failure isolation: a forward that raises is retried on halves of its batch (bisection) until the requests it fails
for are singled out; those alone finish with an error (`Req.error`), the rest of the batch is processed as usual.
A failed forward leaves the pools and the tree consistent: only KV of completed forwards enters the tree (cache.py),
so a blamed request gives up its step's slots and its earlier KV goes to the tree like an aborted request's. With
overlap, the batch launched after a failed one may have read its tokens: it is waited for and redone the same way,
after the failed one. An error while processing one request's output fails that request alone. Only an error in
scheduling itself, or a device fault (a CUDA error poisons everything computed since), leaves memory untrusted:
then the engine calls `recover()`.
"""
from __future__ import annotations

import logging
import random
from dataclasses import dataclass

import torch

from ..continuation import Continuation, ran_a_call
from ..core import Req
from ..jump_forward import REQUEUE, JumpForwarder
from ..prefix_encode import PrefixEncoder
from ..runner import Launch, ModelRunner, ScheduledBatch, StepOutput
from . import decode, prefill
from .cache import CacheManager
from .config import SchedulerConfig
from .policy import PolicyContext, get_policy

log = logging.getLogger(__name__)


@dataclass
class _InFlight:
    sb: ScheduledBatch
    launch: Launch | None  # None: its launch raised
    redo: bool = False  # run it again synchronously (its launch failed, or it may have read a failed batch's tokens)


class Scheduler:
    def __init__(self, runner: ModelRunner, cfg: SchedulerConfig, *, disable_radix_cache: bool = False,
                 tokenizer=None, seed: int = 0, grammars=None, enable_jump_forward: bool = True,
                 debug_checks: bool = False, overlap: bool = False):
        """`grammars`: the engine's GrammarCache (jump-forward needs its tokenizer tables). `debug_checks`: assert,
        after every jump, that the output ids are the tokenizer's canonical encoding of the output text.
        `overlap`: process each batch while the next one runs (module docstring)."""
        get_policy(cfg.policy)  # an unknown name fails here, not in a step
        self.runner, self.cfg, self.tokenizer = runner, cfg, tokenizer
        self.encoder = PrefixEncoder(tokenizer) if tokenizer is not None else None  # chains' re-encodings
        self.context_length = runner.context_length
        self.disable_radix_cache = disable_radix_cache
        self.grammars, self.enable_jump_forward, self.debug_checks = grammars, enable_jump_forward, debug_checks
        self.overlap = overlap
        self._rng = random.Random(seed)
        self._jump = JumpForwarder(self)
        self._continuation = Continuation(self)
        self.stats = {"forwards": 0, "prefill_forwards": 0, "decode_forwards": 0, "prompt_tokens": 0,
                      "cached_tokens": 0, "computed_tokens": 0, "retractions": 0, "cache_seconds": 0.0,
                      "mixed_forwards": 0, "jumps": 0, "jump_forward_tokens": 0, "retokenized_tokens": 0,
                      "jump_seconds": 0.0, "canonical_checks": 0, "aborted": 0, "failed_forwards": 0,
                      "failed_requests": 0, "recoveries": 0, "stale_entries": 0,
                      "continuations": 0, "fused_selects": 0, "forked_branches": 0}
        # Called on the scheduler thread with (r, reason) as each LM call ends: a request's, a chain's step's, a
        # select choice's child's; before a chain moves r on to its next step (benchmarks' per-call cache figures).
        self.on_call_end = None
        self.reset()

    def reset(self) -> None:
        """Forget every request and cached prefix and rebuild the pools. The queues are emptied first: should
        the device refuse the rebuild, the scheduler is at least left with no work. A step in flight is dropped
        (device work queued later runs after it, so its writes cannot land on the new pools' owners)."""
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.chunked: Req | None = None
        # Chain requests between two calls (continuation.py): resident, their next prefill chunk not yet scheduled.
        self.continuing: list[Req] = []
        self.parked: list[Req] = []  # chain requests waiting for their select's choice children (resident)
        self.forking: list[Req] = []  # chain requests waiting for their fork's branch children (no row: KV in the tree)
        self._inflight: _InFlight | None = None
        self._early: list[Req] = []  # finished before their first forward (their whole output was forced)
        self.out: list[Req] = []  # the requests the step under way made progress on
        self.no_match: set[Req] = set()  # requests whose cached prefix is ignored (match_drop_rate)
        self.new_token_ratio = self.cfg.init_new_token_ratio
        r = self.runner
        self.memory = CacheManager(r.num_rows, r.context_length, r.num_slots, disabled=self.disable_radix_cache,
                                   stats=self.stats)
        self.policy_context = PolicyContext(self.memory.tree, self._rng, self.memory.programs)

    # The radix tree and the slot allocator, under the names the engine's stats and the server read.
    @property
    def cache(self):
        return self.memory.tree

    @property
    def allocator(self):
        return self.memory.slots

    @property
    def policy(self):
        return get_policy(self.cfg.policy)

    def recover(self) -> list[Req]:
        """After an error no request could be blamed for (in scheduling itself, or a device fault): the pools and
        the tree are not trusted, so they are rebuilt (the prefix cache is lost). Queued requests hold no KV and
        stay queued (their matches are forgotten; one being admitted when the error struck loses its row with the
        pools); resident ones lose their KV and are dropped. Returns the requests still queued."""
        kept = [r for r in self.waiting if not r.finished and r.fork_parent is None]  # (a branch's parent is lost)
        self.reset()
        for r in kept:
            r.row, r.kv_len, r.kv_done, r.cache_protected_len, r.last_node = -1, 0, 0, 0, None
            r.prefix_slots, r.match_node, r.match_version = None, None, -1
            r.epoch += 1
        self.waiting = kept
        self.stats["recoveries"] += 1
        return kept

    # ---- front ---------------------------------------------------------------------------------------------
    def add(self, req: Req, at: int | None = None) -> None:
        """Queue `req` (at position `at` of the queue: a fork's branches go first; else last)."""
        if req.chain is not None and req.chain.at < 0:
            # A chain whose first step is a select of multi-token choices: its choices' requests are queued now and
            # share the prompt in their batch (continuation.py); no prefill of the prompt of its own.
            if not self._continuation.advance(req, {"type": "stop"}, ""):
                self.finish(req, {"type": "length", "length": 0})  # a choice's prompt is past the context
                self._early.append(req)
            return
        try:
            if req.grammar is not None and req.params.max_new_tokens > 0 and self._jump_forward(req) == "finished":
                if req.finished:  # the grammar forced the whole output: no forward needed
                    self._early.append(req)
                return  # else a chain request went on to its next step (queued by the continuation)
        except Exception as e:  # it holds no KV yet: it fails alone, delivered by the next step
            if _device_fault(e):
                raise
            self._fail(req, e)
            self._early.append(req)
            return
        if self.cfg.match_drop_rate and self._rng.random() < self.cfg.match_drop_rate:
            self.no_match.add(req)
        self.waiting.insert(len(self.waiting) if at is None else at, req)

    @property
    def shares_prefixes_in_batch(self) -> bool:
        """Whether a prefix several queued requests share is computed once (in-batch dedup, cache-aware policies)."""
        return self.policy.cache_aware and not self.cache.disabled

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked or self.continuing or self._early or self._inflight)

    def abort(self, rid) -> Req | None:
        """Finish request `rid` now with an abort reason, wherever it is: queued (never admitted, retracted or
        re-queued by a jump: it holds no KV), running, or in the middle of a chunked prefill. A resident request's
        computed KV goes to the radix tree like a finished request's (its computed prefix stays reusable).
        Returns the request, or None when no unfinished request has that id (it finished already: nothing to do)."""
        places = {"waiting": self.waiting, "running": self.running,
                  "in a chunked prefill": [self.chunked] if self.chunked is not None else [],
                  "between two calls of its chain": self.continuing, "scoring a select's choices": self.parked,
                  "running its fork's branches": self.forking}
        hit = next(((where, r) for where, reqs in places.items() for r in reqs if str(r.rid) == str(rid)), None)
        if hit is None:
            return None
        where, r = hit
        if r is self.chunked:
            self.chunked = None
        if r in self.waiting:
            self.waiting.remove(r)
        self.finish(r, {"type": "abort", "message": f"aborted while {where}"})
        self.stats["aborted"] += 1
        return r

    def flush_cache(self) -> bool:
        """Drop every cached prefix. Only when idle (as SGLang): cached slots may be in use otherwise."""
        if self.has_work:
            return False
        self.cache.evict(self.cache.total_size)
        self.cache.reset()
        return True

    # ---- the step ------------------------------------------------------------------------------------------
    def step(self) -> list[Req]:
        """Launch one forward and process the one before it (with overlap) or this one (without). Returns the
        requests that produced output (finished ones have `.finished`), those failed by a fault among them,
        finished with `.error` set."""
        self.out, self._early = self._early, []
        new = self._launch_next()
        prev, self._inflight = self._inflight, None
        if prev is not None:
            self.out += self._complete(prev, new)
            if new is None:  # nothing could go ahead of prev (its requests' ends were known before their tokens):
                new = self._launch_next()  # what its outputs started (a chain's next call) goes now, not a loop later
        if new is not None:
            if new.redo:
                self.out += self._run_sync(new.sb)
            else:
                self.runner.sample(new.launch, self._grammar_rows(new.sb))
                if self.overlap:
                    self._inflight = new
                else:
                    self.out += self._complete(new, None)
        return self.out

    def _launch_next(self) -> _InFlight | None:
        sb = self._schedule_prefill() or self._schedule_decode()
        if sb is None and self.continuing:  # nothing decodes after all: the chains waiting for company go now
            sb = prefill.schedule_prefill(self, batch_chains=False)
        return self._launch(sb) if sb is not None else None

    def _schedule_prefill(self) -> ScheduledBatch | None:
        return prefill.schedule_prefill(self)

    def _schedule_decode(self) -> ScheduledBatch | None:
        return decode.schedule_decode(self)

    def _retract(self) -> Req:
        return decode.retract(self)

    def _launch(self, sb: ScheduledBatch) -> _InFlight:
        try:
            return _InFlight(sb, self.runner.launch(sb))
        except Exception as e:
            if _device_fault(e):
                raise
            return _InFlight(sb, None, redo=True)

    def _grammar_rows(self, sb: ScheduledBatch) -> list:
        """Per entry, the request whose grammar masks its row: none for stale entries (their matcher moved on)."""
        return [r if r.grammar is not None and r.epoch == e else None for r, e in zip(sb.reqs, sb.epochs)]

    def _complete(self, f: _InFlight, after: _InFlight | None) -> list[Req]:
        """Collect f's output and process it. If its forward failed, the batch launched after it (which may have
        read f's tokens) is waited for and marked for a redo, and f is redone by bisection."""
        try:
            if f.launch is None:
                raise RuntimeError("launch failed")
            out = self.runner.collect(f.launch)
        except Exception as e:
            if _device_fault(e):
                raise
            if after is not None and not after.redo:
                self.runner.wait(after.launch)
                after.redo = True
            return self._run_sync(f.sb)
        self._count(f.sb)
        return self._process(f.sb, out)

    def _count(self, sb: ScheduledBatch) -> None:
        self.stats["forwards"] += 1
        self.stats["decode_forwards" if sb.is_decode else "prefill_forwards"] += 1

    def _run_sync(self, sb: ScheduledBatch) -> list[Req]:
        """Run `sb` now (launch, sample, collect), bisecting on failure; its stale entries are left out first
        (their slots may belong to someone else by now). So are borrowers of a block whose lender's forward was
        never collected (it failed, or the lender let go of it before a redo): nothing would fill the slots they
        read, so they go back to the queue."""
        for r, e in zip(sb.reqs, sb.epochs):
            b = r.block
            if r.epoch == e and b is not None and b.lender is not r and not b.computed:
                decode.requeue(self, r)
        live = [i for i, (r, e) in enumerate(zip(sb.reqs, sb.epochs)) if r.epoch == e]
        if len(live) < len(sb):
            sb = sb.select(live)
        return self._run(sb) if len(sb) else []

    def _run(self, sb: ScheduledBatch) -> list[Req]:
        try:
            out = self.runner.run(sb)
        except Exception as e:
            if _device_fault(e):
                raise
            self.stats["failed_forwards"] += 1
            if len(sb) == 1:
                self._fail(sb.reqs[0], e, keep=sb.prefix_lens[0])
                return sb.reqs
            half = len(sb) // 2  # (each half as a redo: a request failed in the first may strand one in the second)
            return (self._run_sync(sb.select(list(range(half))))
                    + self._run_sync(sb.select(list(range(half, len(sb))))))
        self._count(sb)
        return self._process(sb, out)

    def _fail(self, r: Req, exc: BaseException, keep: int | None = None) -> None:
        """Finish `r` with an error: a fault in this step was blamed on it. Its KV from position `keep` on (the
        failed forward's, and any scheduled after it) is dropped; its earlier KV is sound and goes to the tree, as
        an aborted request's does."""
        if r.row >= 0:
            self.memory.truncate(r, r.kv_done if keep is None else min(keep, r.kv_done))
        if r is self.chunked:
            self.chunked = None
        for q in (self.running, self.waiting, self.continuing, self.parked, self.forking):
            if r in q:
                q.remove(r)
        self.memory.release(r)
        r.finished, r.error = True, f"{type(exc).__name__}: {exc}"
        r.finish_reason = {"type": "abort", "message": f"internal error: {r.error}"}
        self.stats["failed_requests"] += 1
        log.error("request %s failed inside a step; the other requests carry on", r.rid, exc_info=exc)
        if r.chain is not None and r.chain.children is not None:  # a fork's parent: its branches end with it
            self._continuation.end_branches(r)
        for parent in (r.parent, r.fork_parent):  # a select's choice, a fork's branch: its chain fails with it
            if parent is not None and not parent.finished:
                self._fail(parent, exc)
                self.out.append(parent)

    # ---- after the forward ---------------------------------------------------------------------------------
    def _process(self, sb: ScheduledBatch, out: StepOutput) -> list[Req]:
        progressed = []
        riders = set(sb.from_buffer)
        for i, r in enumerate(sb.reqs):
            if r.epoch != sb.epochs[i]:  # r let go of its KV since this was scheduled: the output is stale
                self.stats["stale_entries"] += 1
                continue
            pre, ext = sb.prefix_lens[i], sb.extend_lens[i]
            r.kv_done = max(r.kv_done, pre + ext)  # the forward filled these slots
            if r.block is not None and r.block.lender is r:
                r.block.computed = True  # its borrowers' reads are sound, even in a redo
            r.computed_tokens = max(r.computed_tokens, pre + ext)
            r.forward_passes += 1
            self.stats["computed_tokens"] += ext
            try:
                if self._process_one(r, pre + ext, out.next_ids[i], out.out_logprobs[i], out.in_logprobs[i],
                                     sb.is_decode or i in riders):
                    progressed.append(r)
            except Exception as e:  # this request's output broke something: it fails alone
                if _device_fault(e):
                    raise
                self._fail(r, e)
                progressed.append(r)
        return progressed

    def _process_one(self, r: Req, upto: int, nid: int | None, olp, ilp, decoding: bool) -> bool:
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
            if upto < len(r.fill_ids):  # a non-final chunk: share what it has so far
                self.memory.cache_unfinished(r)
                return False
            self.finish(r, {"type": "length", "length": 0})  # max_new_tokens == 0: prefill only
            return True
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
                if jumped == REQUEUE:
                    self.waiting.insert(0, r)
                return True
        if reason is not None:
            if not decoding and r.chain is not None:
                # A chain's call that ended in its prefill (a select scored by ids) goes on holding its KV: its
                # prompt is shared now, as any prefilled request's, not at the chain's end. Else the requests
                # queued behind it (the other instances of a batch, a fork's other branches) wait for it a forward
                # or more: in-batch dedup counts the chain's next chunk as computing that prefix.
                self.memory.cache_unfinished(r)
            self.finish(r, reason)
        elif not decoding:
            self.memory.cache_unfinished(r)  # its prompt is computed: requests queued behind it can share it
        return True

    def _jump_forward(self, r: Req) -> str | None:
        return self._jump(r)

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
        if r.seq_len >= self.context_length:
            return {"type": "length", "length": n}
        return None

    def finish(self, r: Req, reason: dict) -> None:
        """r's call ended with `reason`. A chain request with a next step goes on to it instead (continuation.py);
        else r is finished and gives up its KV."""
        text = self._output_text(r, reason)
        if self.on_call_end is not None and ran_a_call(r):
            self.on_call_end(r, reason)
        if r.chain is not None and self._continuation.advance(r, reason, text):
            return
        r.finished, r.finish_reason = True, reason
        self.no_match.discard(r)
        for q in (self.running, self.continuing, self.parked, self.forking):
            if r in q:
                q.remove(r)
        self.memory.release(r)
        r.text = text
        if r.chain is not None and r.chain.children is not None:
            self._continuation.end_branches(r)  # (none left, unless r was aborted or failed)
        if r.fork_parent is not None:
            self._continuation.branch_done(r)
        if r.parent is not None:
            self._continuation.child_done(r)
            if r.parent.finished or r.parent in self.continuing or r.parent in self.waiting:
                self.out.append(r.parent)  # it progressed (its select's segment is out): deliver it

    def _output_text(self, r: Req, reason: dict) -> str:
        """The text of r's output, cut before the stop string it stopped at."""
        if self.tokenizer is None:
            return ""
        text = self.tokenizer.decode(r.output_ids, skip_special_tokens=True)
        if reason.get("type") == "stop" and isinstance(reason.get("matched"), str):
            text = text[:text.find(reason["matched"])]
        return text

    # ---- invariants ----------------------------------------------------------------------------------------
    def resident(self) -> list[Req]:
        """Requests holding KV: running, the chunked one, and any whose only forward is still in flight."""
        out = list(self.running) + [r for r in self.continuing + self.parked if r.row >= 0]
        if self.chunked is not None and self.chunked not in out:
            out.append(self.chunked)
        f = self._inflight
        if f is not None:
            out += [r for r, e in zip(f.sb.reqs, f.sb.epochs) if r.epoch == e and r.row >= 0 and r not in out]
        return out

    def check_invariants(self) -> None:
        """Slot accounting (cache.py's invariant) over the resident requests, and the runner's copy of the slot table
        equal to the host's over their positions, but those written since the last batch (they go with the next)
        and those the batch still in flight writes (its forward may yet fail; a redo writes them again)."""
        resident = self.resident()
        self.memory.check(resident)
        skip: dict[int, list[tuple[int, int]]] = {}
        for row, span in self.memory.pending.items():
            skip.setdefault(row, []).append(span)
        f = self._inflight
        if f is not None:
            sb = f.sb
            for row, pre, ext in zip(sb.rows, sb.prefix_lens, sb.extend_lens):
                skip.setdefault(row, []).append((pre, pre + ext))
            for row, start, slots in sb.table_writes:
                skip.setdefault(row, []).append((start, start + len(slots)))
        self.runner.check_table(self.memory.table, [(r.row, r.kv_len, skip.get(r.row, [])) for r in resident])


def _device_fault(e: BaseException) -> bool:
    """A CUDA error (illegal address, device-side assert) poisons the context: nothing computed since, KV
    included, can be trusted, so no retry can isolate it. Out-of-memory is no such fault (a smaller batch fits)."""
    accel = getattr(torch, "AcceleratorError", None)
    return (accel is not None and isinstance(e, accel)) or "CUDA error" in str(e)
