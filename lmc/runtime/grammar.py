"""Grammar-constrained decoding with xgrammar: compile a request's regex / JSON schema / EBNF once per distinct
grammar, give each request its own matcher, and mask the logits of constrained rows before sampling.

xgrammar is imported only when a request carries a grammar, so the engine runs without it otherwise.

    cache = GrammarCache(tokenizer, vocab_size, eos_ids)
    req.grammar = cache.matcher(params)          # in Engine.make_request (caller's thread); RequestError if bad
    apply_grammar_masks(logits, reqs, vocab)     # in ModelRunner._postprocess, before sampling
    req.grammar.accept_token(tok)                # in Scheduler._process; is_terminated() -> finish
    cache.jump_forward()                         # the JumpForward helper: forced strings -> canonical token ids

Jump-forward (SGLang's compressed FSM, paper section 4 and appendix B.2): when the grammar forces a string, the
scheduler appends it without sampling. `JumpForward.jump` turns the forced string into token ids by retokenizing a
suffix window of the output (so the ids stay the tokenizer's canonical encoding of the output text), rolls the
matcher back to the first token that changed and accepts the new ones; the scheduler then drops the KV of the
changed tokens and re-prefills the new ones through the radix cache.
"""
from __future__ import annotations

import bisect
import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch

from .core import RequestError, SamplingParams

GRAMMAR_FIELDS = ("regex", "json_schema", "ebnf")
_UNCHANGED = object()
_LOG_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: (Check failed: .*? is false: )?")


def _xgr():
    try:
        import xgrammar
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise RequestError("constrained decoding (regex / json_schema / ebnf) needs the xgrammar package: "
                           "pip install xgrammar") from e
    return xgrammar


def grammar_of(params: SamplingParams) -> tuple[str, str] | None:
    """(kind, text) of the request's grammar, or None. A dict schema is serialized keeping its key order (the
    order of `properties` is the order the generated JSON follows)."""
    for kind in GRAMMAR_FIELDS:
        value = getattr(params, kind)
        if value is not None:
            if isinstance(value, str):
                return kind, value
            try:
                return kind, json.dumps(value)
            except (TypeError, ValueError) as e:
                raise RequestError(f"invalid {kind}: not serializable as JSON ({e})") from None
    return None


def _short(text: str, n: int = 200) -> str:
    return text if len(text) <= n else text[:n] + f"... ({len(text)} chars)"


class GrammarBusy(RequestError):
    """Too many grammars are compiling at once (the request may be retried later; a server answers 503)."""


class GrammarCache:
    """Compiled grammars keyed by (kind, text), over one xgrammar compiler built lazily from the HF tokenizer.

    `compiled` is an LRU of compiled grammars: identical grammars (e.g. a batch of requests sharing a schema)
    compile once. It holds at most `max_entries` grammars and `max_bytes` of them (xgrammar's own estimate); the
    least recently used are evicted (`evictions` counts them). `compiles` counts actual compilations.

    A compilation runs in a thread of this cache's own pool and is waited for at most `compile_timeout` seconds
    (RequestError naming the grammar past that). xgrammar cannot be interrupted, so a timed-out compilation goes
    on in its thread (its result is then cached); at most `max_compiling` compilations run or wait at once, and
    beyond that `compile` raises GrammarBusy at once. Concurrent requests for the same grammar share one
    compilation. Thread-safe: callers compile in their own threads (Engine.make_request)."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...] = (), max_threads: int = 2,
                 max_entries: int = 256, max_bytes: int = 1 << 30, compile_timeout: float | None = 30.0,
                 max_compiling: int = 4):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.max_threads = max_threads
        self.compiled: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self.compiles = self.evictions = self.timeouts = 0
        self._compiler = None
        self.info = None  # xgrammar TokenizerInfo, built with the compiler
        self._jump = None
        self._lock = threading.Lock()  # guards the compiler's creation
        self._state = threading.Lock()  # guards compiled, _running and the counters
        self._running: dict[tuple[str, str], Future] = {}
        self._pool: ThreadPoolExecutor | None = None
        self.configure(max_entries=max_entries, max_bytes=max_bytes, compile_timeout=compile_timeout,
                       max_compiling=max_compiling)

    def configure(self, *, max_entries: int | None = None, max_bytes: int | None = None,
                  compile_timeout: Any = _UNCHANGED, max_compiling: int | None = None) -> None:
        """Change the limits (a server sets them from its flags; None leaves one as it is, except compile_timeout
        where None means no timeout); evicts down to the new bounds at once."""
        if max_entries is not None:
            if max_entries < 1:
                raise ValueError(f"max_entries must be >= 1, got {max_entries}")
            self.max_entries = max_entries
        if max_bytes is not None:
            self.max_bytes = max_bytes
        if compile_timeout is not _UNCHANGED:
            if compile_timeout is not None and compile_timeout <= 0:
                raise ValueError(f"compile_timeout must be > 0 seconds or None, got {compile_timeout}")
            self.compile_timeout = compile_timeout
        if max_compiling is not None:
            if max_compiling < 1:
                raise ValueError(f"max_compiling must be >= 1, got {max_compiling}")
            with self._state:
                if self._pool is not None and max_compiling != self.max_compiling:
                    self._pool.shutdown(wait=False)  # running compilations finish in their threads
                    self._pool = None
                self.max_compiling = max_compiling
        with self._state:
            self._evict()

    def stats(self) -> dict[str, int]:
        with self._state:
            return {"entries": len(self.compiled), "bytes": self.cached_bytes, "compiles": self.compiles,
                    "evictions": self.evictions, "timeouts": self.timeouts, "compiling": len(self._running),
                    "max_entries": self.max_entries}

    def _get_compiler(self):
        if self._compiler is None:
            xgr = _xgr()
            self.info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                           stop_token_ids=self.stop_token_ids or None)
            # Jump-forward's tokenizer tables (~0.1 s), built here so the first compile (in a caller's thread)
            # pays for them rather than the scheduler loop.
            self._jump = JumpForward(self.tokenizer, self.info, self.vocab_size)
            # xgrammar's own cache is off: it is unbounded, and `compiled` is the (bounded) cache.
            self._compiler = xgr.GrammarCompiler(self.info, max_threads=self.max_threads, cache_enabled=False)
        return self._compiler

    def jump_forward(self) -> "JumpForward | None":
        """The jump-forward helper for this tokenizer, or None when the tokenizer cannot retokenize text exactly
        (see JumpForward.supported). Built with the compiler, i.e. before any request has a grammar."""
        if self._jump is None:
            with self._lock:
                self._get_compiler()
        return self._jump if self._jump.supported else None

    def compile(self, kind: str, text: str):
        key = (kind, text)
        if self._compiler is None:  # built once, in the caller's thread: not part of any grammar's timeout
            with self._lock:
                self._get_compiler()
        with self._state:
            hit = self.compiled.get(key)
            if hit is not None:
                self.compiled.move_to_end(key)
                return hit
            fut = self._running.get(key)
            if fut is None:
                if len(self._running) >= self.max_compiling:
                    raise GrammarBusy(f"{len(self._running)} grammars are compiling already (the limit); "
                                      f"retry the {kind} request later")
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(self.max_compiling, thread_name_prefix="lmc-grammar")
                fut = self._running[key] = Future()
                self._pool.submit(self._compile_into, key, fut)
        try:
            return fut.result(timeout=self.compile_timeout)
        except FutureTimeout:
            with self._state:
                self.timeouts += 1
            raise RequestError(f"invalid {kind} {_short(text)!r}: it did not compile within "
                               f"{self.compile_timeout:g} s; simplify it") from None

    def _compile_into(self, key: tuple[str, str], fut: Future) -> None:
        """In a pool thread: compile `key`, cache it, resolve `fut` (RequestError when the grammar is invalid)."""
        kind, text = key
        compiler = self._compiler
        try:
            try:
                if kind == "regex":
                    cg = compiler.compile_regex(text)
                elif kind == "json_schema":
                    cg = compiler.compile_json_schema(text, any_whitespace=False)
                elif kind == "ebnf":
                    cg = compiler.compile_grammar(text)
                else:
                    raise ValueError(f"unknown grammar kind {kind!r}")
            except Exception as e:  # xgrammar raises RuntimeError with a log-style prefix
                msg = _LOG_PREFIX.sub("", str(e).strip().splitlines()[0] if str(e).strip() else repr(e))
                raise RequestError(f"invalid {kind} {_short(text)!r}: {msg}") from None
        except BaseException as e:  # noqa: BLE001 - handed to the waiting callers
            with self._state:
                del self._running[key]
            fut.set_exception(e)
            return
        with self._state:
            del self._running[key]
            self.compiles += 1
            self.compiled[key] = cg
            self._evict()
        fut.set_result(cg)

    def _evict(self) -> None:
        """Drop least recently used grammars beyond the bounds; the most recent one always stays (it may alone
        exceed max_bytes). The caller holds _state."""
        while len(self.compiled) > 1 and (len(self.compiled) > self.max_entries or
                                          self.cached_bytes > self.max_bytes):
            self.compiled.popitem(last=False)
            self.evictions += 1

    @property
    def cached_bytes(self) -> int:
        """Memory of the cached grammars, by xgrammar's estimate (summed: entries are few)."""
        return sum(cg.memory_size_bytes for cg in list(self.compiled.values()))

    def matcher(self, params: SamplingParams):
        """A fresh GrammarMatcher for the request's grammar, or None when it has none."""
        g = grammar_of(params)
        if g is None:
            return None
        if self.tokenizer is None:
            raise RequestError(f"{g[0]} needs a tokenizer, and this model has none (dummy weights): constrained "
                               "decoding is unavailable")
        cg = self.compile(*g)
        xgr = _xgr()
        if params.stop_token_ids:  # user stop tokens end the grammar too (only where the grammar may end)
            stops = list(dict.fromkeys(self.stop_token_ids + list(params.stop_token_ids)))
            return xgr.GrammarMatcher(cg, override_stop_tokens=stops)
        return xgr.GrammarMatcher(cg)


def apply_grammar_masks(logits: torch.Tensor, reqs: list, vocab_size: int) -> None:
    """Mask, in place, the rows of `logits` ([len(reqs), V]) whose request has a grammar: tokens the grammar
    forbids next become -inf. The bitmask is filled on the CPU, then applied on the logits' device."""
    rows = [i for i, r in enumerate(reqs) if getattr(r, "grammar", None) is not None]
    if not rows:
        return
    xgr = _xgr()
    bitmask = xgr.allocate_token_bitmask(len(reqs), vocab_size)
    apply = [i for i in rows if reqs[i].grammar.fill_next_token_bitmask(bitmask, i)]
    if not apply:
        return  # every constrained row allows every token here
    if bitmask.device != logits.device:
        bitmask = bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab_size, indices=apply)


class JumpForward:
    """Tokenizer side of jump-forward: turn a forced string into the canonical token ids of the output text.

    `jump(matcher, out, canonical_len)` retokenizes a suffix window of the output: the bytes of its last tokens
    plus the forced string. The window starts MARGIN tokens before `canonical_len` (the output before it is the
    canonical encoding of its text: it ended at the last jump) and at least MIN_WINDOW tokens from the end, and
    is widened (doubled) while its first token changes, up to the whole output. It never reaches into the prompt,
    so the prompt/output boundary is kept (no fusion with the prompt's last token). The matcher is rolled back
    to the first changed token and accepts the new ones.

    The last token of the result is held back when it lies wholly inside the forced string and the grammar
    allows a longer token that extends it (MLC-LLM's rule): the model then picks that token itself, so the jump
    never creates a boundary a canonical tokenization would not have."""

    MARGIN = 4
    MIN_WINDOW = 8

    def __init__(self, tokenizer, info, vocab_size: int):
        xgr = _xgr()
        self.vocab: list[bytes] = list(info.decoded_vocab)  # token id -> its bytes (0.1-0.2 s: once)
        self.vocab_size = vocab_size
        self.stop_ids = list(info.stop_token_ids)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:  # a fast tokenizer: skip transformers' Python wrapper (~1.6x faster)
            self.encode = lambda text: backend.encode(text, add_special_tokens=False).ids
        else:  # pragma: no cover - slow tokenizers
            self.encode = lambda text: tokenizer.encode(text, add_special_tokens=False)
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        order = sorted(range(len(self.vocab)), key=self.vocab.__getitem__)  # for _extensions: byte order
        self._keys, self._order = [self.vocab[i] for i in order], torch.tensor(order, dtype=torch.int64)
        # Retokenizing a suffix needs encode(text) to spell exactly `text` (no prefix space, no normalization).
        probes = ['{"a": [1, 2.5], "b c": "d"}', " x  y\n", "Hello, World!"]
        self.supported = all(self._bytes(self.encode(p)) == p.encode() for p in probes)

    def _bytes(self, ids) -> bytes:
        vocab = self.vocab
        return b"".join(vocab[t] for t in ids)

    # ---- grammar queries -----------------------------------------------------------------------------------
    def _allowed(self, matcher) -> torch.Tensor | None:
        """Bool [vocab] of the tokens the matcher allows next, or None when it allows every token."""
        if not matcher.fill_next_token_bitmask(self.bitmask, 0):
            return None
        words = self.bitmask[0]
        bits = (words[:, None] >> torch.arange(32, dtype=torch.int32)) & 1
        return bits.flatten()[:self.vocab_size].bool()

    def forced_stop(self, matcher) -> int | None:
        """The stop token to append when the grammar is complete and allows nothing but a stop token."""
        if not matcher.is_completed() or matcher.is_terminated():
            return None
        allowed = self._allowed(matcher)
        if allowed is None:
            return None
        ids = allowed.nonzero().flatten().tolist()
        if not ids or any(t not in self.stop_ids for t in ids):
            return None
        return next(t for t in self.stop_ids if t in ids)

    def _extensions(self, tid: int) -> torch.Tensor:
        """Ids of the tokens whose bytes strictly extend token `tid`'s: in byte order, the run [b, next(b))."""
        keys, ids = self._keys, self._order
        b = self.vocab[tid]
        if not b:
            return ids[:0]
        lo = bisect.bisect_right(keys, b)
        stem = b.rstrip(b"\xff")
        hi = bisect.bisect_left(keys, stem[:-1] + bytes([stem[-1] + 1])) if stem else len(keys)
        return ids[lo:hi]

    def _hold_last(self, matcher, last: int, jump_bytes: int) -> bool:
        """Hold back the jump's last token when it lies wholly inside the forced string and the grammar, at the
        point before it, allows a longer token that extends it."""
        if len(self.vocab[last]) > jump_bytes:
            return False
        ext = self._extensions(last)
        ext = ext[ext < self.vocab_size]
        if not len(ext):
            return False
        allowed = self._allowed(matcher)
        return allowed is None or bool(allowed[ext].any())

    # ---- the jump ------------------------------------------------------------------------------------------
    def retokenize(self, out: list[int], jump: str, canonical_len: int) -> tuple[int, list[int]] | None:
        """(i, ids): the canonical ids of bytes(out[i:]) + jump, for the suffix window starting at i. None when
        the window's text is not valid UTF-8 at the output's start or does not round-trip through the tokenizer."""
        n, tail = len(out), jump.encode()
        i = max(0, min(canonical_len - self.MARGIN, n - self.MIN_WINDOW))
        while True:
            window = self._bytes(out[i:]) + tail
            try:
                new = self.encode(window.decode("utf-8"))
            except UnicodeDecodeError:  # the window starts inside a character: widen it
                new = None
            if new is not None and (i == 0 or (new and new[0] == out[i])):
                break
            if i == 0:
                return None
            i = max(0, i - max(n - i, self.MIN_WINDOW))
        if self._bytes(new) != window:
            return None
        return i, new

    def jump(self, matcher, out: list[int], canonical_len: int) -> tuple[int, list[int]] | None:
        """Apply the grammar's forced string to the output `out` (every id of which the matcher accepted).
        Returns (k, new_out): new_out[:k] == out[:k], the matcher has been rolled back by len(out) - k and has
        accepted new_out[k:]. None (matcher untouched) when there is nothing to jump."""
        s = matcher.find_jump_forward_string()
        if not s:
            return None
        got = self.retokenize(out, s, canonical_len)
        if got is None:
            return None
        i, new = got
        new_out = out[:i] + new
        k = i
        limit = min(len(out), len(new_out))
        while k < limit and out[k] == new_out[k]:
            k += 1
        if len(out) - k:
            matcher.rollback(len(out) - k)
        accepted, ok = 0, True
        for t in new_out[k:-1]:
            if not matcher.accept_token(t):
                ok = False
                break
            accepted += 1
        if ok:
            if self._hold_last(matcher, new_out[-1], len(s.encode())):
                new_out = new_out[:-1]
            elif matcher.accept_token(new_out[-1]):
                accepted += 1
            else:
                ok = False
        if ok and new_out != out:
            return k, new_out
        # a rejected token (cannot happen for a byte-exact retokenization) or nothing gained: restore the matcher
        if accepted > 0:
            matcher.rollback(accepted)
        for t in out[k:]:
            ok = matcher.accept_token(t)
            assert ok, "restoring the matcher after an aborted jump failed"
        return None
