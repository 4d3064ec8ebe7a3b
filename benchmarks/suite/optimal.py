"""The optimal cache hit rate of a workload (the SGLang paper's Theorem 3.1: with a cache that holds everything,
visiting the prefix tree of the requests depth-first computes every tree node exactly once, and no order computes
fewer).

Given every prefill request a system sent, in submission order, as (prompt ids, output ids, first position whose
logits the request needs), the least number of prompt tokens any engine must compute is:

- one per distinct prompt prefix (a node of the prefix tree of all prompts), except prefixes that an earlier
  request's generated tokens already put in the KV cache (decode computes them);
- plus the positions whose logits a request needs although their KV is cached: its last prompt token (the next
  token is sampled from it) and, for prompt logprobs (select scoring), every position from where they start.

optimal hit rate = 1 - that minimum / all prompt tokens. The prompts come from the run itself, so programs whose
later prompts depend on generated text are covered.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence


@dataclass
class Request:
    prompt: Sequence[int]
    output: Sequence[int] = ()
    logits_from: int | None = None  # first prompt position whose logits are needed (default: the last one)


@dataclass
class Optimum:
    prompt_tokens: int
    min_computed: int

    @property
    def hit_rate(self) -> float:
        return 1.0 - self.min_computed / self.prompt_tokens if self.prompt_tokens else 0.0


def optimum(requests: Iterable[Request]) -> Optimum:
    """Walk a token trie (one dict of children per node) in submission order, counting what must be computed."""
    children: list[dict[int, int]] = [{}]
    total = computed = 0
    for r in requests:
        n = len(r.prompt)
        if n == 0:
            continue
        total += n
        need_from = n - 1 if r.logits_from is None else max(0, min(r.logits_from, n - 1))
        node = 0
        for i, tok in enumerate(r.prompt):
            nxt = children[node].get(tok)
            if nxt is None:
                nxt = len(children)
                children.append({})
                children[node][tok] = nxt
                computed += 1
            elif i >= need_from:
                computed += 1  # cached, but its logits are needed
            node = nxt
        # the generated tokens (all but the last, which no forward has seen) are in the cache afterwards
        for tok in list(r.output)[:-1]:
            nxt = children[node].get(tok)
            if nxt is None:
                nxt = len(children)
                children.append({})
                children[node][tok] = nxt
            node = nxt
    return Optimum(total, computed)
