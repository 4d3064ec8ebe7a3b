"""Jump-forward decoding (SGLang's compressed-FSM decoding) on the scheduler's side.

After a constrained request accepts a token, a string its grammar forces is appended without sampling. The output
is retokenized over a suffix window (grammar.JumpForward) so its ids stay the canonical encoding of its text, the
matcher is rolled back to the first changed token, and the request leaves the batch: its KV up to the first changed
token goes into the radix tree, the rest is freed, and it is re-queued, so its next prefill matches the unchanged
prefix and computes only the new tokens (the "KV rollback" costs nothing). A grammar that is complete and allows
only a stop token gets it appended too. Forced tokens carry no logprob (they were not sampled).

With overlap scheduling a jumping request may already sit in the next, in-flight step: releasing its KV starts a
new epoch, so that entry's output is dropped as stale.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from .core import Req

if TYPE_CHECKING:
    from .scheduler import Scheduler

REQUEUE, FINISHED = "requeue", "finished"


class JumpForwarder:
    def __init__(self, s: "Scheduler"):
        self.s = s

    def helper(self):
        s = self.s
        if not s.enable_jump_forward or s.grammars is None or s.tokenizer is None:
            return None
        return s.grammars.jump_forward()

    def __call__(self, r: Req) -> str | None:
        """Append what r's grammar forces now. Returns None (nothing forced: r carries on), FINISHED, or REQUEUE:
        r is no longer resident and the caller queues it."""
        jf = self.helper()
        if jf is None:
            return None
        s, stats = self.s, self.s.stats
        t0 = time.perf_counter()
        out, m = r.output_ids, r.grammar
        got = jf.jump(m, out, r.canonical_len)
        k, new_out = got if got is not None else (len(out), list(out))
        stop = jf.forced_stop(m)
        if got is None and stop is None:
            stats["jump_seconds"] += time.perf_counter() - t0
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
            s.memory.truncate(r, min(r.kv_len, len(r.input_ids) + k))
            if r in s.running:
                s.running.remove(r)
        s.memory.release(r)
        r.computed_tokens = min(r.computed_tokens, len(r.input_ids) + k)
        r.match_version = -1
        added = len(new_out) - k
        r.jumps += 1
        r.jump_forward_tokens += added
        r.retokenized_tokens += len(out) - k
        stats["jumps"] += 1
        stats["jump_forward_tokens"] += added
        stats["retokenized_tokens"] += len(out) - k
        if r.params.return_logprob:
            del r.output_logprobs[k:], r.output_top_logprobs[k:]
            r.output_logprobs.extend((None, t, None) for t in new_out[k:])
            r.output_top_logprobs.extend([None] * added)
            if r.params.token_ids_logprob is not None:
                del r.output_token_ids_logprobs[k:]
                r.output_token_ids_logprobs.extend([None] * added)
        r.output_ids = new_out
        r.canonical_len = len(new_out) - (stop is not None)
        reason = self._finish_reason(r, added, stop)
        if s.debug_checks and (reason is None or reason["type"] == "stop"):
            self._check_canonical(r, stop)
        stats["jump_seconds"] += time.perf_counter() - t0
        if reason is not None:
            s.finish(r, reason)
            return FINISHED
        return REQUEUE

    def _finish_reason(self, r: Req, added: int, stop: int | None) -> dict | None:
        s, p, n = self.s, r.params, len(r.output_ids)
        limit = min(p.max_new_tokens, s.context_length - len(r.input_ids))
        if n > limit:  # the forced tokens overshoot the budget: cut them there
            del r.output_ids[limit:]
            del r.output_logprobs[limit:], r.output_top_logprobs[limit:]
            if stop is not None and r.output_ids[-1:] != [stop]:
                stop = None
        if stop is not None:
            return {"type": "stop", "matched": stop}
        if p.stop and s.tokenizer is not None and len(r.output_ids) >= p.min_new_tokens:
            window = max(len(x) for x in p.stop) + 2 + added
            tail = s.tokenizer.decode(r.output_ids[-window:], skip_special_tokens=True)
            hit = [x for x in p.stop if x in tail]
            if hit:
                return {"type": "stop", "matched": hit[0]}
        if len(r.output_ids) >= limit:
            return {"type": "length", "length": len(r.output_ids)}
        return None

    def _check_canonical(self, r: Req, stop: int | None) -> None:
        tok = self.s.tokenizer
        ids = r.output_ids[:-1] if stop is not None else r.output_ids
        text = tok.decode(ids)
        canonical = tok.encode(text, add_special_tokens=False)
        assert ids == canonical, (f"after a jump the output ids are not the canonical encoding of {text!r}: "
                                  f"{ids} != {canonical}")
        self.s.stats["canonical_checks"] += 1
