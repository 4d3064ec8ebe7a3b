"""Core records of the runtime: sampling parameters, requests and their results.

A `Req` is the scheduler's unit of work. Its token sequence is `fill_ids = input_ids + output_ids`. KV positions,
through the request's row of the slot table (scheduler/cache.py owns the accounting):
- `kv_len`: positions with slots allocated, including those of forwards still in flight;
- `kv_done`: positions whose KV a completed (collected) forward computed, `kv_done <= kv_len`; only these ever go
  into the radix tree;
- `cache_protected_len <= kv_done`: the leading positions whose slots belong to the tree;
- `block_end`: positions [cache_protected_len, block_end) hold slots a shared block owns (borrowed, cache.py).
Between steps without overlap, a decoding request has exactly one token (the last sampled one) without KV:
`kv_done == kv_len == len(fill_ids) - 1`. With a step in flight, its next position is already allocated and its
last token may still be on the device: `kv_len == len(fill_ids)`.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import Any


class RequestError(ValueError):
    """A request the engine refuses (bad sampling value, too long a prompt, ...). Fails that request alone."""


class EngineError(RuntimeError):
    """The engine failed while running this request (a fault inside a step, not the request's fault as far as
    validation can tell). Only the requests blamed for the fault get it; the others carry on."""


# Bounds on request fields, so that nothing a request carries can make a step fail or run away with memory.
INT_MAX = 2**63 - 1  # every integer field ends up in a C long (torch, the tokenizer) somewhere
MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed takes a 64-bit value; seeds are 0 <= seed <= MAX_SEED
MAX_TOKEN_LIST = 2048  # stop_token_ids, token_ids_logprob, logit_bias entries
MAX_STOP_STRINGS = 64
MAX_STOP_LEN = 512  # characters per stop string (stop checks and stream hold-back scan this much of the tail)


@dataclass
class SamplingParams:
    """Per-request sampling and logprob options (SGLang's names). `validate()` names the offending field."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None  # logprobs of these ids at every output position (SGLang's name)
    # OpenAI's logit_bias: token id (an int or its decimal string) -> bias in [-100, 100], added to the logits
    # before sampling. Normalized to {int: float} by validate(); returned logprobs stay the model's own.
    logit_bias: dict[int, float] | None = None
    # Constrained decoding (at most one; compiled by xgrammar, see grammar.py).
    regex: str | None = None
    json_schema: str | dict | None = None
    ebnf: str | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None, **limits) -> "SamplingParams":
        """`limits`: the model-dependent bounds of `validate()` (vocab_size, max_top_logprobs)."""
        if d is not None and not isinstance(d, Mapping):
            raise RequestError(f"sampling_params must be a map of parameter -> value, got {type(d).__name__}")
        d = dict(d or {})
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise RequestError(f"unknown sampling parameter(s): {sorted(unknown)}")
        return cls(**d).validate(**limits)

    def validate(self, vocab_size: int | None = None, max_top_logprobs: int | None = None) -> "SamplingParams":
        """Check every field (types, ranges, finiteness, list sizes) and normalize `stop` to a list and
        `logit_bias` to {int: float}. With `vocab_size`, token ids must be in [0, vocab_size) wherever they appear;
        `top_logprobs_num` is bounded by the vocabulary and by `max_top_logprobs`. Raises RequestError naming the
        field. After this, nothing in the params can make a step raise."""
        def need(ok: bool, name: str, rule: str) -> None:
            if not ok:
                raise RequestError(f"invalid sampling parameter {name}={_short(getattr(self, name))}: {rule}")

        for name in ("max_new_tokens", "min_new_tokens", "top_k", "logprob_start_len", "top_logprobs_num"):
            need(_is_int(getattr(self, name)) and abs(getattr(self, name)) <= INT_MAX, name,
                 f"must be an integer of at most {INT_MAX}")
        for name in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
                     "repetition_penalty"):
            v = getattr(self, name)
            need(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v), name,
                 "must be a finite number")
        for name in ("ignore_eos", "return_logprob"):
            need(isinstance(getattr(self, name), bool), name, "must be true or false")
        need(self.max_new_tokens >= 0, "max_new_tokens", "must be >= 0")
        need(0 <= self.min_new_tokens <= self.max_new_tokens, "min_new_tokens", "must be in [0, max_new_tokens]")
        need(self.temperature >= 0, "temperature", "must be >= 0")
        need(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")
        need(self.top_k == -1 or self.top_k >= 1, "top_k", "must be -1 (off) or >= 1")
        need(0 <= self.min_p <= 1, "min_p", "must be in [0, 1]")
        need(-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]")
        need(-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]")
        need(0 < self.repetition_penalty <= 2, "repetition_penalty", "must be in (0, 2]")
        need(self.top_logprobs_num >= 0, "top_logprobs_num", "must be >= 0")
        need(self.logprob_start_len >= -1, "logprob_start_len", "must be >= -1")
        need(self.seed is None or (_is_int(self.seed) and 0 <= self.seed <= MAX_SEED), "seed",
             f"must be an integer in [0, {MAX_SEED}] or None")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        need(self.stop is None or (isinstance(self.stop, (list, tuple)) and len(self.stop) <= MAX_STOP_STRINGS
                                   and all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_LEN for s in self.stop)),
             "stop", f"must be a non-empty string of at most {MAX_STOP_LEN} characters or a list of at most "
                     f"{MAX_STOP_STRINGS} of them")
        self.stop = list(self.stop) if self.stop is not None else None
        for name in ("stop_token_ids", "token_ids_logprob"):
            ids = getattr(self, name)
            need(ids is None or (isinstance(ids, (list, tuple)) and len(ids) <= MAX_TOKEN_LIST
                                 and all(_is_int(t) and 0 <= t < (vocab_size or INT_MAX) for t in ids)), name,
                 f"must be a list of at most {MAX_TOKEN_LIST} token ids" +
                 (f" in [0, {vocab_size})" if vocab_size else ""))
            if ids is not None:
                setattr(self, name, list(ids))
        if self.logit_bias is not None:
            self.logit_bias = _logit_bias(self.logit_bias, vocab_size)
        if vocab_size is not None:
            top = min(vocab_size, max_top_logprobs if max_top_logprobs is not None else vocab_size)
            need(self.top_logprobs_num <= top, "top_logprobs_num", f"must be at most {top}")
        need(self.regex is None or (isinstance(self.regex, str) and self.regex != ""), "regex",
             "must be a non-empty string")
        need(self.json_schema is None or isinstance(self.json_schema, dict)
             or (isinstance(self.json_schema, str) and self.json_schema.strip() != ""), "json_schema",
             "must be a JSON schema (a dict or its JSON text)")
        need(self.ebnf is None or (isinstance(self.ebnf, str) and self.ebnf.strip() != ""), "ebnf",
             "must be a non-empty EBNF grammar string")
        given = [n for n in ("regex", "json_schema", "ebnf") if getattr(self, n) is not None]
        if len(given) > 1:
            raise RequestError(f"at most one of regex, json_schema, ebnf may be given: got {', '.join(given)}")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _short(v, limit: int = 80) -> str:
    """repr of a refused value, cut short: an error message must not echo a megabyte back."""
    text = repr(v)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


def _logit_bias(bias, vocab_size: int | None) -> dict[int, float] | None:
    """{token id: bias} from OpenAI's shape (ids may be decimal strings); RequestError naming the bad entry."""
    def bad(rule: str):
        return RequestError(f"invalid sampling parameter logit_bias: {rule}")

    if not isinstance(bias, Mapping):
        raise bad("must be a map of token id -> bias in [-100, 100]")
    if len(bias) > MAX_TOKEN_LIST:
        raise bad(f"at most {MAX_TOKEN_LIST} entries, got {len(bias)}")
    out = {}
    for k, v in bias.items():
        if isinstance(k, str) and k.isascii() and k.isdigit() and len(k) <= 20:
            k = int(k)
        if not _is_int(k) or k < 0:
            raise bad(f"key {_short(k)} is not a token id (a non-negative integer or its decimal string)")
        if vocab_size is not None and k >= vocab_size:
            raise bad(f"token id {k} is outside the model's vocabulary [0, {vocab_size})")
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not -100 <= v <= 100:
            raise bad(f"the bias of token {k} must be a number in [-100, 100], got {_short(v)}")
        out[k] = float(v)
    return out or None


_req_ids = itertools.count()


@dataclass(eq=False)
class Req:
    """One generation request as the scheduler sees it."""

    input_ids: list[int]
    params: SamplingParams
    rid: int = field(default_factory=lambda: next(_req_ids))
    output_ids: list[int] = field(default_factory=list)
    # KV bookkeeping (see module docstring). `row` is the slot-table row, -1 when not resident.
    row: int = -1
    kv_len: int = 0
    kv_done: int = 0
    cache_protected_len: int = 0
    last_node: Any = None  # radix node locked by this request (pins its path)
    # Positions [cache_protected_len, block_end) of the row hold a SharedBlock's slots (scheduler/cache.py): a
    # prefix another request's forward computes, borrowed before it reached the tree. 0: none.
    block: Any = None
    block_end: int = 0
    # Bumped whenever the request gives up its KV (finished, aborted, retracted, re-queued by a jump): a batch
    # entry scheduled under an older epoch is stale, and its output is dropped.
    epoch: int = 0
    # Prefix-match result, refreshed by the scheduler before admission.
    prefix_slots: Any = None
    match_node: Any = None
    match_version: int = -1  # radix-cache version the match was taken at
    cached_tokens: int = 0  # prompt tokens served from the prefix cache, not computed by this request (meta_info)
    computed_tokens: int = 0  # high-water mark of tokens this request prefilled/decoded itself
    forward_passes: int = 0
    # Output side.
    finished: bool = False
    finish_reason: dict | None = None
    error: str | None = None  # set when a fault inside a step was blamed on this request (it failed alone)
    text: str = ""
    input_logprobs: list = field(default_factory=list)
    input_top_logprobs: list = field(default_factory=list)
    output_logprobs: list = field(default_factory=list)
    output_top_logprobs: list = field(default_factory=list)
    output_token_ids_logprobs: list = field(default_factory=list)
    on_progress: Any = None  # callback(req), called on the scheduler thread after each step that advanced it
    grammar: Any = None  # xgrammar GrammarMatcher when the request is constrained (regex / json_schema / ebnf)
    program: Any = None  # lmc.protocol.ProgramHints: the request's program instance and plan position (hints only)
    chain: Any = None  # continuation.Chain: the LM calls this one request runs in a row (None: a single call)
    parent: Any = None  # the chain request whose select this one scores (one choice: `choice`), queued by the engine
    choice: int = -1
    # Prompt logprobs stop before this token (None: the prompt's end). A fused select's child (continuation.py):
    # its choice's tokens only, not the next call's text it prefills on into.
    logprob_end: int | None = None
    fork_parent: Any = None  # the chain request whose fork this one is a branch of (continuation.py), engine-queued
    continuing_since: int = 0  # the scheduler's forward count when the chain last entered `continuing`
    # Jump-forward (jump_forward.py): tokens placed without sampling, tokens they replaced when the output was
    # retokenized, number of jumps, and the length of the output prefix known to be canonically tokenized.
    jump_forward_tokens: int = 0
    retokenized_tokens: int = 0
    jumps: int = 0
    canonical_len: int = 0

    @property
    def fill_ids(self) -> list[int]:
        return self.input_ids + self.output_ids

    @property
    def seq_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def logprob_start(self) -> int:
        """First prompt position whose logprob is returned (SGLang: -1 means only the output)."""
        p = self.params
        if not p.return_logprob or p.logprob_start_len < 0:
            return len(self.input_ids)
        return min(p.logprob_start_len, len(self.input_ids))

    @property
    def next_prompt_logprob(self) -> int:
        """First prompt position whose logprob is still to be recorded (len(input_ids) once none is left)."""
        return self.logprob_start + len(self.input_logprobs)

    def meta_info(self) -> dict:
        """SGLang's meta_info. Usage: `prompt_tokens` = len(input_ids); `completion_tokens` = len(output_ids),
        forced (jump-forward) tokens included; `cached_tokens` = how many of the prompt tokens were served from
        the prefix cache instead of being computed by this request (0 <= cached_tokens <= prompt_tokens). Output
        tokens found in the cache when a jump-forward re-prefills, and tokens recomputed after a retraction, are
        not counted."""
        meta = {
            "id": str(self.rid),
            "prompt_tokens": len(self.input_ids),
            "completion_tokens": len(self.output_ids),
            "cached_tokens": self.cached_tokens,
            "finish_reason": self.finish_reason,
            "forward_passes": self.forward_passes,
            "jump_forward_tokens": self.jump_forward_tokens,
            "jumps": self.jumps,
            "retokenized_tokens": self.retokenized_tokens,
        }
        if self.params.return_logprob:
            meta["input_token_logprobs"] = self.input_logprobs
            meta["output_token_logprobs"] = self.output_logprobs
            if self.params.top_logprobs_num:
                meta["input_top_logprobs"] = self.input_top_logprobs
                meta["output_top_logprobs"] = self.output_top_logprobs
            if self.params.token_ids_logprob is not None:
                meta["output_token_ids_logprobs"] = self.output_token_ids_logprobs
        return meta

    def result(self) -> dict:
        """The last call's text, ids and meta info; a chain's also has every finished step's `segments` and the
        first step not run, `stopped_at` (None: every step ran)."""
        out = {"text": self.text, "output_ids": list(self.output_ids), "meta_info": self.meta_info()}
        if self.chain is not None:
            out.update(segments=list(self.chain.segments), stopped_at=self.chain.stopped_at)
        return out
