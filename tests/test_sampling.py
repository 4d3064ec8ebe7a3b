"""The batched sampler (lmc/runtime/sampling.py) against per-request references written out row by row."""
import pytest
import torch

from lmc.runtime.core import Req, SamplingParams
from lmc.runtime.sampling import sample, seeded_exponential

V = 64
EOS = (2,)


def req(out=(), **params) -> Req:
    r = Req([1, 5, 7], SamplingParams(**params).validate())
    r.output_ids = list(out)
    return r


def penalized_reference(row: torch.Tensor, r: Req) -> torch.Tensor:
    """One row, the textbook way: each distinct output token penalized once by repetition, by count by frequency."""
    row = row.clone()
    p = r.params
    for t in set(r.output_ids):
        c = r.output_ids.count(t)
        if p.repetition_penalty != 1.0:
            row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
        row[t] -= p.frequency_penalty * c + p.presence_penalty
    return row


def test_penalties_in_one_pass_equal_the_per_row_reference():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, V, generator=g) * 3
    reqs = [req([3, 3, 9, 40], temperature=0, repetition_penalty=1.3),
            req([3, 4, 4, 4], temperature=0, frequency_penalty=0.7, presence_penalty=-0.4),
            req([], temperature=0, frequency_penalty=2.0),  # no outputs yet: untouched
            req([10, 11], temperature=0),  # no penalty: untouched
            req([63, 0, 63], temperature=0, repetition_penalty=0.6, frequency_penalty=-1.0, presence_penalty=1.5)]
    expected = torch.stack([penalized_reference(logits[i], r) for i, r in enumerate(reqs)])
    got = logits.clone()
    picked = sample(got, reqs, EOS)  # all greedy: penalties applied in place, then argmax
    torch.testing.assert_close(got, expected)
    assert picked.tolist() == expected.argmax(-1).tolist()


def test_min_new_tokens_bans_stop_and_eos_but_a_constrained_row_that_can_only_stop_keeps_them():
    logits = torch.zeros(3, V)
    logits[:, 2] = 10.0  # EOS is everyone's favourite
    logits[:, 7] = 9.0
    reqs = [req([], temperature=0, min_new_tokens=2, stop_token_ids=[7]),
            req([1, 1], temperature=0, min_new_tokens=2),  # reached its minimum
            req([], temperature=0, min_new_tokens=3)]
    reqs[2].grammar = object()  # a constrained row (test double: only its presence is read here)
    logits[2] = float("-inf")
    logits[2, 2] = 0.0  # the grammar allows only EOS
    # row 0: 2 and 7 banned, every other logit is 0 -> the first id; row 1: free to stop; row 2: the grammar wins
    assert sample(logits.clone(), reqs, EOS).tolist() == [0, 2, 2]


def test_seeded_noise_is_a_function_of_seed_step_and_token_only():
    a = seeded_exponential([7, 8, 7], [0, 0, 1], V, torch.device("cpu"))
    alone = seeded_exponential([7], [0], V, torch.device("cpu"))
    torch.testing.assert_close(a[0], alone[0], rtol=0, atol=0)
    assert not torch.equal(a[0], a[1]) and not torch.equal(a[0], a[2])
    assert torch.isfinite(a).all() and (a > 0).all()
    big = seeded_exponential([123456789012345, -5], [3, 4], 49152, torch.device("cpu"))
    # Exp(1): mean 1, variance 1, P(E > 1) = 1/e
    assert big.mean().item() == pytest.approx(1.0, abs=0.03)
    assert big.var().item() == pytest.approx(1.0, abs=0.08)
    assert (big > 1).float().mean().item() == pytest.approx(0.3679, abs=0.01)


def test_a_seeded_request_samples_the_same_alone_or_in_any_batch():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, V, generator=g)
    mine = req([4, 5], temperature=0.9, top_p=0.9, seed=11)
    alone = sample(logits[:1].clone(), [mine], EOS)
    others = [req([], temperature=1.0), req([3], temperature=0), req([], temperature=1.3, seed=12)]
    for order in ([mine, *others], [*others, mine]):
        rows = torch.cat([logits[:1], logits[1:]]) if order[0] is mine else torch.cat([logits[1:], logits[:1]])
        got = sample(rows.clone(), order, EOS)
        assert got[order.index(mine)].item() == alone.item()


def test_seeded_sampling_follows_the_distribution_and_its_filters():
    probs = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03] + [0.0] * (V - 5))
    logits = probs.clamp_min(1e-30).log().expand(2000, V).clone()
    plain = [req([], temperature=1.0, seed=s) for s in range(2000)]
    counts = torch.bincount(sample(logits.clone(), plain, EOS), minlength=V).float() / 2000
    assert counts[:5].tolist() == pytest.approx(probs[:5].tolist(), abs=0.035)
    # top_k=2 keeps {0, 1}; top_p=0.8 keeps {0, 1, 2} (mass before token 2 is 0.75 < 0.8); min_p=0.2 keeps {0, 1, 2}
    for params, allowed in (({"top_k": 2}, {0, 1}), ({"top_p": 0.8}, {0, 1, 2}), ({"min_p": 0.2}, {0, 1, 2})):
        reqs = [req([], temperature=1.0, seed=s, **params) for s in range(400)]
        assert set(sample(logits[:400].clone(), reqs, EOS).tolist()) == allowed


def test_greedy_rows_take_the_argmax_in_a_mixed_batch():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(6, V, generator=g)
    reqs = [req([], temperature=0), req([], temperature=1.0, seed=1), req([], temperature=0.5, top_k=1),
            req([], temperature=1.0), req([], temperature=0), req([], temperature=2.0, seed=3)]
    got = sample(logits.clone(), reqs, EOS)
    for i in (0, 2, 4):
        assert got[i].item() == logits[i].argmax().item()


def reference_sample(row: torch.Tensor, r: Req) -> int:
    """One request alone, the textbook way: softmax at its temperature, its top-k / top-p / min-p written out over
    a Python sort, then the exponential race with its own seeded noise."""
    p = r.params
    if p.greedy:
        return int(row.argmax())
    probs = torch.softmax(row / max(p.temperature, 1e-5), dim=-1)
    order = sorted(range(len(probs)), key=lambda t: -float(probs[t]))
    keep, mass = set(), 0.0
    for rank, t in enumerate(order):
        pt = float(probs[t])
        if (p.top_k > 0 and rank >= p.top_k) or mass > p.top_p or pt < p.min_p * float(probs[order[0]]):
            mass += pt
            continue
        keep.add(t)
        mass += pt
    kept = torch.tensor([float(probs[t]) if t in keep else 0.0 for t in range(len(probs))])
    noise = seeded_exponential([p.seed], [len(r.output_ids)], len(probs), torch.device("cpu"))[0]
    return int((kept / noise).argmax())


def test_a_mixed_batch_samples_what_each_request_samples_alone():
    """Per-batch parameter tensors must keep every row's parameters on its own row."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(8, V, generator=g) * 2
    reqs = [req([1, 2], temperature=0.7, top_k=5, seed=1), req([], temperature=0),
            req([9], temperature=1.3, top_p=0.6, seed=2), req([], temperature=1.0, min_p=0.3, seed=3),
            req([4, 4, 4], temperature=0.9, top_k=3, top_p=0.9, min_p=0.05, seed=4), req([], temperature=0.2, seed=5),
            req([], temperature=0, top_k=2), req([3], temperature=2.0, seed=6)]
    for trial in range(5):
        rows = logits + trial  # softmax-invariant shift, new noise positions through output lengths below
        for r in reqs:
            r.output_ids.append(trial)
        got = sample(rows.clone(), reqs, EOS).tolist()
        assert got == [reference_sample(rows[i], r) for i, r in enumerate(reqs)]
