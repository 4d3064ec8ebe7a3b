"""Batched sampling: penalties, min-tokens, temperature, top-k / top-p / min-p, per-request seeds. Rows of
constrained requests arrive already masked by their grammar (runner.py / grammar.py).

Every stage is one set of tensor operations over the whole batch: the only per-request Python is reading each
request's parameters into flat lists (O(batch) list building, no per-request tensor op).

Sampling uses the exponential-race form of the Gumbel trick (argmax of p / E with E ~ Exp(1)), which is exact
categorical sampling. Unseeded rows share one draw from torch's global generator. Seeded rows draw E from a
counter-based hash of (seed, output position, token id) (`seeded_exponential`), so a seeded request's samples
depend only on its seed and its own tokens, never on what else shares its batch, and all seeded rows of a batch
take one vectorized draw. Logprobs returned to users are those of the raw model distribution: before penalties,
grammar masks and `logit_bias` (vLLM's default `raw_logprobs`; OpenAI does not document its choice), so a token
forced by a +100 bias still reports how likely the model found it.
"""
from __future__ import annotations

import itertools

import torch

from .core import Req

_M31 = 0x7FFFFFFF  # hash arithmetic stays in 31 bits so int64 products never overflow


def _mix31(x: torch.Tensor) -> torch.Tensor:
    """An integer avalanche hash (the two-round xorshift-multiply of Wang / Mueller), kept to 31 bits."""
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _M31
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _M31
    return x ^ (x >> 16)


def seeded_exponential(seeds: list[int], steps: list[int], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(seeds), vocab] Exp(1) draws, a pure function of (seed, step, column): row i is the noise of a request
    seeded `seeds[i]` sampling its `steps[i]`-th output token."""
    key = [((s ^ (s >> 31)) & _M31) for s in seeds]  # fold any Python int seed into 31 bits
    rows = _mix31((_mix31(torch.tensor(key, device=device)) + torch.tensor(steps, device=device)) & _M31)
    cols = _mix31(torch.arange(vocab, device=device) + 0x2545F491)
    bits = _mix31(rows[:, None] ^ cols[None, :])
    u = (bits.to(torch.float64) + 0.5) / float(1 << 31)  # in (0, 1): E is finite and > 0
    return (-torch.log(u)).to(torch.float32)


def _penalize(logits: torch.Tensor, reqs: list[Req]) -> None:
    """Repetition, frequency and presence penalties over each request's output tokens, in one pass."""
    rows = [i for i, r in enumerate(reqs) if r.output_ids and (
        r.params.frequency_penalty or r.params.presence_penalty or r.params.repetition_penalty != 1.0)]
    if not rows:
        return
    dev, vocab = logits.device, logits.shape[1]
    lens = [len(reqs[i].output_ids) for i in rows]
    flat = list(itertools.chain.from_iterable(reqs[i].output_ids for i in rows))
    counts = torch.zeros(len(rows), vocab, dtype=logits.dtype, device=dev)
    counts.index_put_((torch.repeat_interleave(torch.arange(len(rows), device=dev), torch.tensor(lens, device=dev)),
                       torch.tensor(flat, device=dev)), torch.ones(len(flat), dtype=logits.dtype, device=dev),
                      accumulate=True)
    params = torch.tensor([[reqs[i].params.repetition_penalty, reqs[i].params.frequency_penalty,
                            reqs[i].params.presence_penalty] for i in rows], dtype=logits.dtype, device=dev)
    rep, freq, pres = params[:, 0:1], params[:, 1:2], params[:, 2:3]
    idx = torch.tensor(rows, device=dev)
    x, seen = logits[idx], counts > 0
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    logits[idx] = x - freq * counts - pres * seen.to(logits.dtype)


def _ban_until_min_tokens(logits: torch.Tensor, reqs: list[Req], eos_ids: tuple[int, ...]) -> None:
    """Stop and EOS tokens are -inf until a request has min_new_tokens outputs. A constrained row whose grammar can
    only end here keeps them: the grammar wins over min_new_tokens."""
    ban_rows, ban_cols = [], []
    for i, r in enumerate(reqs):
        p = r.params
        if len(r.output_ids) < p.min_new_tokens:
            banned = list(p.stop_token_ids or ()) + ([] if p.ignore_eos else list(eos_ids))
            ban_rows.extend([i] * len(banned))
            ban_cols.extend(banned)
    if not ban_rows:
        return
    dev = logits.device
    ri, ci = torch.tensor(ban_rows, device=dev), torch.tensor(ban_cols, device=dev)
    saved = logits[ri, ci]
    logits[ri, ci] = float("-inf")
    constrained = [i for i in set(ban_rows) if reqs[i].grammar is not None]
    if constrained:
        dead = torch.zeros(len(reqs), dtype=torch.bool, device=dev)
        c = torch.tensor(constrained, device=dev)
        dead[c] = ~torch.isfinite(logits[c]).any(-1)
        keep = dead[ri]
        logits[ri[keep], ci[keep]] = saved[keep]


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


def _filter(probs: torch.Tensor, reqs: list[Req]) -> torch.Tensor:
    """Zero the probabilities top-k, top-p and min-p drop, all rows at once (one sort of the batch)."""
    dev, vocab = probs.device, probs.shape[1]
    sorted_p, order = probs.sort(dim=-1, descending=True)
    limits = torch.tensor([[r.params.top_k if r.params.top_k > 0 else vocab, r.params.top_p, r.params.min_p]
                           for r in reqs], dtype=torch.float64, device=dev)
    top_k, top_p, min_p = limits[:, 0:1], limits[:, 1:2].to(probs.dtype), limits[:, 2:3].to(probs.dtype)
    rank = torch.arange(vocab, device=dev)[None, :]
    drop = (rank >= top_k) | (sorted_p.cumsum(-1) - sorted_p > top_p) | (sorted_p < min_p * sorted_p[:, :1])
    return torch.zeros_like(probs).scatter_(1, order, sorted_p.masked_fill(drop, 0.0))


def sample(logits: torch.Tensor, reqs: list[Req], eos_ids: tuple[int, ...]) -> torch.Tensor:
    """logits: [B, V] fp32 (modified in place). Returns the sampled ids [B] (on logits' device)."""
    _penalize(logits, reqs)
    _ban_until_min_tokens(logits, reqs, eos_ids)
    _bias(logits, reqs)
    greedy = [r.params.greedy for r in reqs]
    if all(greedy):
        return logits.argmax(-1)
    dev = logits.device
    temp = torch.tensor([max(r.params.temperature, 1e-5) for r in reqs], device=dev)[:, None]
    probs = torch.softmax(logits / temp, dim=-1)
    if any(r.params.top_k > 0 or r.params.top_p < 1 or r.params.min_p > 0 for r in reqs):
        probs = _filter(probs, reqs)
    noise = torch.empty_like(probs).exponential_()
    seeded = [i for i, r in enumerate(reqs) if r.params.seed is not None and not greedy[i]]
    if seeded:
        noise[torch.tensor(seeded, device=dev)] = seeded_exponential(
            [reqs[i].params.seed for i in seeded], [len(reqs[i].output_ids) for i in seeded], probs.shape[1], dev)
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
