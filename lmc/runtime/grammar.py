"""Grammar-constrained decoding with xgrammar: compile a request's regex / JSON schema / EBNF once per distinct
grammar, give each request its own matcher, and mask the logits of constrained rows before sampling.

xgrammar is imported only when a request carries a grammar, so the engine runs without it otherwise.

    cache = GrammarCache(tokenizer, vocab_size, eos_ids)
    req.grammar = cache.matcher(params)          # in Engine.make_request (caller's thread); RequestError if bad
    apply_grammar_masks(logits, reqs, vocab)     # in ModelRunner._postprocess, before sampling
    req.grammar.accept_token(tok)                # in Scheduler._process; is_terminated() -> finish
"""
from __future__ import annotations

import json
import re
import threading
from typing import Any

import torch

from .core import RequestError, SamplingParams

GRAMMAR_FIELDS = ("regex", "json_schema", "ebnf")
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


class GrammarCache:
    """Compiled grammars keyed by (kind, text), over one xgrammar compiler built lazily from the HF tokenizer.

    `compiled` is the dict of compiled grammars: identical grammars (e.g. a batch of requests sharing a schema)
    compile once. `compiles` counts actual compilations. Thread-safe: callers compile in their own threads."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...] = (), max_threads: int = 2):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.max_threads = max_threads
        self.compiled: dict[tuple[str, str], Any] = {}
        self.compiles = 0
        self._compiler = None
        self._lock = threading.Lock()

    def _get_compiler(self):
        if self._compiler is None:
            xgr = _xgr()
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_token_ids or None)
            self._compiler = xgr.GrammarCompiler(info, max_threads=self.max_threads)
        return self._compiler

    def compile(self, kind: str, text: str):
        key = (kind, text)
        hit = self.compiled.get(key)
        if hit is not None:
            return hit
        with self._lock:
            hit = self.compiled.get(key)
            if hit is not None:
                return hit
            compiler = self._get_compiler()
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
            self.compiles += 1
            self.compiled[key] = cg
            return cg

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
