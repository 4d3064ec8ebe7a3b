"""What each system sent, for the cache figures: every LM call of an lmc engine (chain steps one by one), or every
API call of an lmc.OpenAI backend (prompts tokenized here with the model's tokenizer, the same one the server uses).

The recorders hook one method or callback of one object for the length of a `with` block and restore it after;
they change nothing the system does.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from optimal import Optimum, Request, optimum


@dataclass
class CacheFigures:
    prompt_tokens: int
    cached_tokens: int
    optimal: Optimum
    calls: Counter = field(default_factory=Counter)  # API calls by purpose (API systems)
    tokenization_mismatches: int = 0  # API prompts whose local tokenization disagrees with the server's count

    @property
    def hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass
class EngineCall:
    """One LM call as the engine ran it, copied when it ended (a chain's Req is reset for its next call)."""
    request: Request
    cached_tokens: int


class EngineRecorder:
    """Records every LM call an lmc Engine runs, in the order they end, through its scheduler's `on_call_end`: a
    plain request, each step of a chain (engine-side continuation), each choice's child of a select scored by
    child requests. Each call's prompt, output and cached tokens are its own (a chain step's prompt is the whole
    chain's text so far; what it kept of its own KV is its cached prefix)."""

    def __init__(self, engine):
        self.scheduler, self.calls = engine.scheduler, []

    def __enter__(self):
        def record(r, reason):
            logits_from = r.logprob_start - 1 if r.params.return_logprob else None
            self.calls.append(EngineCall(Request(list(r.input_ids), list(r.output_ids), logits_from),
                                         r.cached_tokens))
        self.scheduler.on_call_end = record
        return self

    def __exit__(self, *exc):
        self.scheduler.on_call_end = None

    def figures(self) -> CacheFigures:
        calls = list(self.calls)
        return CacheFigures(sum(len(c.request.prompt) for c in calls), sum(c.cached_tokens for c in calls),
                            optimum(c.request for c in calls), Counter(engine_calls=len(calls)))


class APIRecorder:
    """Records an lmc.OpenAI backend's calls (its _create): the prompt sent, the usage that came back."""

    def __init__(self, backend, tokenizer):
        self.backend, self.tokenizer, self.calls, self.tokenize_calls = backend, tokenizer, [], 0

    def __enter__(self):
        create, tokenize = self.backend._create, self.backend._tokenize

        async def recording(kind, kw):
            out = await create(kind, kw)
            self.calls.append((kind, kw, out))
            return out

        async def counting(*args, **kwargs):  # select lowering asks the server for the prompt's length
            out = await tokenize(*args, **kwargs)
            self.tokenize_calls += out is not None
            return out
        self.backend._create, self.backend._tokenize = recording, counting
        return self

    def __exit__(self, *exc):
        del self.backend._create, self.backend._tokenize

    def _prompt_ids(self, kind: str, kw: dict) -> list[list[int]]:
        tok = self.tokenizer
        if kind == "chat":
            extra = kw.get("extra_body") or {}
            cont = bool(extra.get("continue_final_message"))
            return [tok.apply_chat_template(kw["messages"], tokenize=True, add_generation_prompt=not cont,
                                            continue_final_message=cont, return_dict=False)]
        prompts = kw["prompt"] if isinstance(kw["prompt"], list) else [kw["prompt"]]
        return [p if isinstance(p, list) else tok.encode(p) for p in prompts]

    def figures(self) -> CacheFigures:
        reqs, calls = [], Counter()
        prompt = cached = mismatches = 0
        for kind, kw, out in self.calls:
            if kw.get("logit_bias"):
                calls["logit_bias_step"] += 1
            elif kw.get("echo"):
                calls["select_scoring"] += 1
            elif kw.get("max_tokens") == 0:
                calls["prompt_length"] += 1  # select lowering: the prompt's token count before scoring
            elif kw.get("response_format"):
                calls["select_or_schema_via_response_format"] += 1
            else:
                calls["gen"] += 1
            usage = out.get("usage") or {}
            prompt += usage.get("prompt_tokens") or 0
            cached += (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            ids = self._prompt_ids(kind, kw)
            mismatches += sum(len(x) for x in ids) != (usage.get("prompt_tokens") or 0)
            choices = sorted(out.get("choices") or [], key=lambda c: c.get("index", 0))
            for i, p in enumerate(ids):
                text = ""
                if len(ids) == 1 and choices:
                    ch = choices[0]
                    text = (ch.get("message") or {}).get("content") if kind == "chat" else ch.get("text")
                if kw.get("echo"):  # echo returns every prompt position's logprob: all their logits are needed
                    reqs.append(Request(p, [], 0))
                else:
                    reqs.append(Request(p, self.tokenizer.encode(text or "", add_special_tokens=False)))
        if self.tokenize_calls:
            calls["tokenize"] = self.tokenize_calls
        return CacheFigures(prompt, cached, optimum(reqs), calls, mismatches)


class BackendRecorder:
    """Records the requests of a backend that keeps its own list (`backend.requests`: the transformers peer, which
    caches nothing)."""

    def __init__(self, backend):
        self.backend = backend

    def __enter__(self):
        self.backend.requests = []
        return self

    def __exit__(self, *exc):
        self.reqs, self.backend.requests = self.backend.requests, None

    def figures(self) -> CacheFigures:
        reqs = [Request(p, o, f) for p, o, f in self.reqs]
        return CacheFigures(sum(len(r.prompt) for r in reqs), 0, optimum(reqs), Counter(requests=len(reqs)))
