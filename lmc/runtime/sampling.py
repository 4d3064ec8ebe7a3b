"""Batched sampling: penalties, min-tokens, temperature, top-k / top-p / min-p, per-request seeds. Rows of
constrained requests arrive already masked by their grammar (runner.py / grammar.py).

Every stage is one set of tensor operations over the whole batch. The per-request Python is reading each
request's parameters once per batch into the flat host tensors of `SamplingBatch` (O(batch), no per-request tensor
op), which reach the device in one copy (two with seeded requests).

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
from dataclasses import dataclass

import torch

from .core import Req

_M31 = 0x7FFFFFFF  # hash arithmetic stays in 31 bits so int64 products never overflow


def _mix31(x: torch.Tensor) -> torch.Tensor:
    """An integer avalanche hash (the two-round xorshift-multiply of Wang / Mueller), kept to 31 bits."""
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _M31
    x = ((x ^ (x >> 16)) * 0x45D9F3B) & _M31
    return x ^ (x >> 16)


def _seed_key(seed: int) -> int:
    return (seed ^ (seed >> 31)) & _M31  # fold any Python int seed into 31 bits


def _exponential_from_keys(keys: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    rows = _mix31((_mix31(keys) + steps) & _M31)
    cols = _mix31(torch.arange(vocab, device=keys.device) + 0x2545F491)
    bits = _mix31(rows[:, None] ^ cols[None, :])
    u = (bits.to(torch.float64) + 0.5) / float(1 << 31)  # in (0, 1): E is finite and > 0
    return (-torch.log(u)).to(torch.float32)


def seeded_exponential(seeds: list[int], steps: list[int], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(seeds), vocab] Exp(1) draws, a pure function of (seed, step, column): row i is the noise of a request
    seeded `seeds[i]` sampling its `steps[i]`-th output token."""
    return _exponential_from_keys(torch.tensor([_seed_key(s) for s in seeds], device=device),
                                  torch.tensor(steps, device=device), vocab)


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


@dataclass
class SamplingBatch:
    """One batch's sampling parameters as device tensors, read from the requests in one pass and sent to the device
    in one copy (`build`): the stages below are then tensor operations over the whole batch, with no per-request
    Python. Row i is reqs[i]."""

    temperature: torch.Tensor  # [B, 1] fp32, clamped to >= 1e-5
    top_k: torch.Tensor  # [B, 1] fp64, vocab where unlimited
    top_p: torch.Tensor  # [B, 1] fp32
    min_p: torch.Tensor  # [B, 1] fp32
    greedy: torch.Tensor  # [B] bool
    any_greedy: bool
    any_filter: bool  # some row has a top-k, top-p or min-p limit
    # [3, S] of the S seeded requests that sample (not greedy): their rows, output positions and folded seeds;
    # None if there are none
    seeded: torch.Tensor | None

    @classmethod
    def build(cls, reqs: list[Req], vocab: int, device: torch.device) -> "SamplingBatch":
        host = torch.tensor([[max(r.params.temperature, 1e-5), r.params.top_k if r.params.top_k > 0 else vocab,
                              r.params.top_p, r.params.min_p, float(r.params.greedy)] for r in reqs],
                            dtype=torch.float64)
        seeded = [i for i, r in enumerate(reqs) if r.params.seed is not None and not r.params.greedy]
        n_greedy = int(host[:, 4].sum())
        any_filter = bool(((host[:, 1] < vocab) | (host[:, 2] < 1) | (host[:, 3] > 0)).any())
        dev = host.to(device, non_blocking=True)
        seeded_dev = None
        if seeded:
            seeded_dev = torch.tensor([seeded, [len(reqs[i].output_ids) for i in seeded],
                                       [_seed_key(reqs[i].params.seed) for i in seeded]]).to(device, non_blocking=True)
        return cls(temperature=dev[:, 0:1].float(), top_k=dev[:, 1:2], top_p=dev[:, 2:3].float(),
                   min_p=dev[:, 3:4].float(), greedy=dev[:, 4] > 0, any_greedy=n_greedy > 0, any_filter=any_filter,
                   seeded=seeded_dev)


def _filter(probs: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    """Zero the probabilities top-k, top-p and min-p drop, all rows at once (one sort of the batch)."""
    vocab = probs.shape[1]
    sorted_p, order = probs.sort(dim=-1, descending=True)
    top_p, min_p = sb.top_p.to(probs.dtype), sb.min_p.to(probs.dtype)
    rank = torch.arange(vocab, device=probs.device)[None, :]
    drop = (rank >= sb.top_k) | (sorted_p.cumsum(-1) - sorted_p > top_p) | (sorted_p < min_p * sorted_p[:, :1])
    return torch.zeros_like(probs).scatter_(1, order, sorted_p.masked_fill(drop, 0.0))


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax (the first maximal index, as torch.argmax). On the CPU in fp32 the C++ kernel
    (attention/cpu_kernel.py: ~0.1 against torch.max's 0.85 ms over [16, 49152], one thread); else through `max`,
    whose CPU kernel is ~4x faster than argmax's. The GPU keeps argmax."""
    if x.device.type != "cpu":
        return x.argmax(-1)
    if x.dtype == torch.float32 and x.dim() == 2:
        from .attention.cpu_kernel import elementwise

        ops = elementwise()
        if ops is not None:
            return ops.argmax_rows(x.contiguous())
    return x.max(-1).indices


def sample(logits: torch.Tensor, reqs: list[Req], eos_ids: tuple[int, ...]) -> torch.Tensor:
    """logits: [B, V] fp32 (modified in place). Returns the sampled ids [B] (on logits' device)."""
    _penalize(logits, reqs)
    _ban_until_min_tokens(logits, reqs, eos_ids)
    _bias(logits, reqs)
    if all(r.params.greedy for r in reqs):  # before build: a greedy batch needs none of its device tensors
        return _argmax(logits)
    sb = SamplingBatch.build(reqs, logits.shape[1], logits.device)
    probs = torch.softmax(logits / sb.temperature, dim=-1)
    if sb.any_filter:
        probs = _filter(probs, sb)
    noise = torch.empty_like(probs).exponential_()
    if sb.seeded is not None:
        noise[sb.seeded[0]] = _exponential_from_keys(sb.seeded[2], sb.seeded[1], probs.shape[1])
    sampled = _argmax(probs / noise)
    if sb.any_greedy:
        sampled = torch.where(sb.greedy, _argmax(logits), sampled)
    return sampled


def token_logprobs(logprobs: torch.Tensor, ids: torch.Tensor, top_n: int):
    """Per row: (logprob of ids[row], top-n [(logprob, id)]). logprobs: [K, V] log-softmaxed."""
    chosen = logprobs.gather(1, ids[:, None])[:, 0].tolist()
    if not top_n:
        return chosen, [[] for _ in chosen]
    vals, idx = logprobs.topk(top_n, dim=-1)
    tops = [[(v, i, None) for v, i in zip(vr, ir)] for vr, ir in zip(vals.tolist(), idx.tolist())]
    return chosen, tops
