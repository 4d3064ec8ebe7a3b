"""The paged CPU attention kernel (lmc/runtime/attention/cpu_kernel.py) against the gather + SDPA reference, on
scattered slots, prefixes, mixed extend lengths and GQA."""
import pytest
import torch

from lmc.runtime.attention import ForwardBatch, make_backend
from lmc.runtime.attention import cpu_backend
from lmc.runtime.attention.cpu_backend import KERNEL_MAX_EXTEND, CpuAttention
from lmc.runtime.attention.torch_backend import TorchAttention
from lmc.runtime.memory import KVCache


def batch_for(prefix_lens, extend_lens, num_kv_heads, head_dim, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = sum(p + e for p, e in zip(prefix_lens, extend_lens))
    kv = KVCache(1, total + 7, num_kv_heads, head_dim, torch.float32, torch.device("cpu"))
    kv.k[0][1:] = torch.randn(total + 7, num_kv_heads, head_dim, generator=g)
    kv.v[0][1:] = torch.randn(total + 7, num_kv_heads, head_dim, generator=g)
    table = torch.zeros(len(prefix_lens) + 1, 128, dtype=torch.int32)
    slots = (torch.randperm(total + 7, generator=g)[:total] + 1).int()  # scattered, never the dummy slot 0
    out_slots, k = [], 0
    for b, (p, e) in enumerate(zip(prefix_lens, extend_lens)):
        table[b + 1, :p + e] = slots[k:k + p + e]
        out_slots.append(slots[k + p:k + p + e])
        k += p + e
    starts = torch.tensor([0] + list(torch.tensor(extend_lens).cumsum(0)[:-1]))
    t = torch.tensor
    return ForwardBatch(
        is_decode=all(e == 1 for e in extend_lens), rows=torch.arange(1, len(prefix_lens) + 1),
        prefix_lens=t(prefix_lens), extend_lens=t(extend_lens), seq_lens=t(prefix_lens) + t(extend_lens),
        extend_start=starts, max_extend_len=max(extend_lens), max_seq_len=max(p + e for p, e in
                                                                           zip(prefix_lens, extend_lens)),
        positions=torch.cat([torch.arange(p, p + e) for p, e in zip(prefix_lens, extend_lens)]),
        out_slots=torch.cat(out_slots).long(), logits_index=t([0]), kv_cache=kv, req_to_token=table, attn=None)


def attend(backend, batch, q):
    backend.prepare(batch)
    return backend.forward(q, 0, batch)


@pytest.fixture(scope="module")
def kernel_backend():
    backend = make_backend("cpu", torch.device("cpu"))
    if not isinstance(backend, CpuAttention):
        pytest.skip("no C++ toolchain here: the kernel could not be built (the fallback is what runs)")
    return backend


@pytest.mark.parametrize("prefix_lens,extend_lens,heads,kv_heads,head_dim", [
    ([5, 0, 17, 1], [1, 1, 1, 1], 9, 3, 16),  # decode, GQA 3:1
    ([0, 3, 10], [7, 1, 12], 4, 4, 16),  # mixed extends with prefixes, MHA
    ([31], [33], 8, 2, 16),  # one long extend
    # the AVX-512 paths: keys in blocks of 16 with partial last blocks; values with the heads' accumulators in
    # registers (64 dims: up to 4 heads at a time, here 3 and 4 + 2; 128 dims: 2 + 2), and 48 dims (no such path)
    ([40, 15, 0], [1, 1, 2], 9, 3, 64),
    ([100, 16], [1, 3], 12, 2, 64),
    ([33], [1], 8, 2, 128),
    ([20], [2], 4, 2, 48),
])
def test_kernel_matches_gather_and_sdpa(kernel_backend, prefix_lens, extend_lens, heads, kv_heads, head_dim,
                                        monkeypatch):
    monkeypatch.setattr(cpu_backend, "KERNEL_MAX_EXTEND", 64)  # the kernel runs even the extends it hands on
    batch = batch_for(prefix_lens, extend_lens, kv_heads, head_dim)
    q = torch.randn(sum(extend_lens), heads, head_dim, generator=torch.Generator().manual_seed(1))
    got = attend(kernel_backend, batch, q)
    assert isinstance(batch.meta, cpu_backend._KernelArgs)  # the kernel ran, not the reference
    torch.testing.assert_close(got, attend(TorchAttention(), batch, q), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("prefix_lens,extend_lens", [
    ([0], [KERNEL_MAX_EXTEND + 1]),  # one long extend alone
    ([40, 0, 7, 3], [KERNEL_MAX_EXTEND + 5, 1, 3 * KERNEL_MAX_EXTEND, KERNEL_MAX_EXTEND]),  # long, decode, short
])
def test_long_extends_go_to_sdpa_one_request_at_a_time(kernel_backend, prefix_lens, extend_lens):
    batch = batch_for(prefix_lens, extend_lens, 2, 8)
    q = torch.randn(sum(extend_lens), 4, 8, generator=torch.Generator().manual_seed(2))
    got = attend(kernel_backend, batch, q)
    m = batch.meta
    assert isinstance(m, cpu_backend._Mixed) and len(m.long) == sum(e > KERNEL_MAX_EXTEND for e in extend_lens)
    torch.testing.assert_close(got, attend(TorchAttention(), batch, q), atol=2e-6, rtol=1e-5)
