"""Batched sampling: penalties, min-tokens, temperature, top-k / top-p / min-p, per-request seeds. Rows of
constrained requests arrive already masked by their grammar (runner.py / grammar.py).

Sampling uses the exponential-race form of the Gumbel trick (argmax of p / E with E ~ Exp(1)), which is exact
categorical sampling and lets seeded requests draw their noise from their own generator while the rest of the
batch shares one draw. Logprobs returned to users are those of the raw model distribution: before penalties,
grammar masks and `logit_bias` (vLLM's default `raw_logprobs`; OpenAI does not document its choice), so a token
forced by a +100 bias still reports how likely the model found it.
"""
from __future__ import annotations

import torch

from .core import Req


def _penalize(logits: torch.Tensor, reqs: list[Req], eos_ids: tuple[int, ...]) -> None:
    for i, r in enumerate(reqs):
        p = r.params
        if r.output_ids and (p.frequency_penalty or p.presence_penalty or p.repetition_penalty != 1.0):
            ids, counts = torch.tensor(r.output_ids, device=logits.device).unique(return_counts=True)
            row = logits[i]
            if p.repetition_penalty != 1.0:
                sel = row[ids]
                row[ids] = torch.where(sel > 0, sel / p.repetition_penalty, sel * p.repetition_penalty)
            row[ids] -= p.frequency_penalty * counts.to(row.dtype) + p.presence_penalty
        if len(r.output_ids) < p.min_new_tokens:
            banned = list(p.stop_token_ids or ()) + ([] if p.ignore_eos else list(eos_ids))
            if banned:
                saved = logits[i, banned].clone() if r.grammar is not None else None
                logits[i, banned] = float("-inf")
                if saved is not None and not torch.isfinite(logits[i]).any():
                    logits[i, banned] = saved  # the grammar can only end here: it wins over min_new_tokens


def _bias(logits: torch.Tensor, reqs: list[Req]) -> None:
    """Every request's logit_bias in one scatter-add. Applied after the grammar mask and min-tokens bans, whose -inf
    it cannot lift: a bias steers sampling, a constraint is never overridden by it."""
    rows, cols, vals = [], [], []
    for i, r in enumerate(reqs):
        if r.params.logit_bias:
            rows.extend([i] * len(r.params.logit_bias))
            cols.extend(r.params.logit_bias)
            vals.extend(r.params.logit_bias.values())
    if rows:
        dev = logits.device
        logits.index_put_((torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)),
                          torch.tensor(vals, device=dev, dtype=logits.dtype), accumulate=True)


def sample(logits: torch.Tensor, reqs: list[Req], eos_ids: tuple[int, ...]) -> torch.Tensor:
    """logits: [B, V] fp32 (modified in place). Returns the sampled ids [B] (on logits' device)."""
    _penalize(logits, reqs, eos_ids)
    _bias(logits, reqs)
    greedy = [r.params.greedy for r in reqs]
    if all(greedy):
        return logits.argmax(-1)
    dev = logits.device
    temp = torch.tensor([max(r.params.temperature, 1e-5) for r in reqs], device=dev)[:, None]
    probs = torch.softmax(logits / temp, dim=-1)
    if any(r.params.top_k > 0 or r.params.top_p < 1 or r.params.min_p > 0 for r in reqs):
        sorted_p, order = probs.sort(dim=-1, descending=True)
        rank = torch.arange(probs.shape[1], device=dev)[None, :]
        top_k = torch.tensor([r.params.top_k if r.params.top_k > 0 else probs.shape[1] for r in reqs], device=dev)
        top_p = torch.tensor([r.params.top_p for r in reqs], device=dev)
        min_p = torch.tensor([r.params.min_p for r in reqs], device=dev)
        drop = (rank >= top_k[:, None]) | (sorted_p.cumsum(-1) - sorted_p > top_p[:, None])
        drop |= sorted_p < min_p[:, None] * sorted_p[:, :1]
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(1, order, sorted_p)
    noise = torch.empty_like(probs).exponential_()
    for i, r in enumerate(reqs):
        if r.generator is not None:
            noise[i] = torch.empty(probs.shape[1], device=dev).exponential_(generator=r.generator)
    sampled = (probs / noise).argmax(-1)
    if any(greedy):
        sampled = torch.where(torch.tensor(greedy, device=dev), logits.argmax(-1), sampled)
    return sampled


def token_logprobs(logprobs: torch.Tensor, ids: torch.Tensor, top_n: int):
    """Per row: (logprob of ids[row], top-n [(logprob, id)]). logprobs: [K, V] log-softmaxed."""
    chosen = logprobs.gather(1, ids[:, None])[:, 0].tolist()
    if not top_n:
        return chosen, [[] for _ in chosen]
    vals, idx = logprobs.topk(top_n, dim=-1)
    tops = [[(v, i, None) for v, i in zip(vr, ir)] for vr, ir in zip(vals.tolist(), idx.tolist())]
    return chosen, tops
