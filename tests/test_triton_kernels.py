"""The Triton attention kernels against a float64 reference: under Triton's interpreter on a machine without a GPU,
compiled on the GPU where there is one (tests/triton_device.py), and at real shapes on the GPU only."""
from triton_device import kernel_device  # noqa: F401  (first: sets TRITON_INTERPRET where there is no GPU)

import math

import pytest
import torch

pytest.importorskip("triton")

from lmc.runtime.attention import triton_kernels as tk  # noqa: E402


def make_pool(seq_lens, num_kv_heads, head_dim, dtype=torch.float32, seed=0):
    """Random KV pool and slot table for requests with the given total lengths.

    Slots are a random permutation; slot 0 and every unused slot hold NaN, and
    table entries beyond each request's length point at NaN slots, so any read
    the kernels should not make poisons the output.
    """
    gen = torch.Generator().manual_seed(seed)
    total = sum(seq_lens)
    num_slots = 1 + total + 16
    k_buf = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen)
    v_buf = torch.randn(num_slots, num_kv_heads, head_dim, generator=gen)
    perm = torch.randperm(num_slots - 1, generator=gen) + 1
    used, unused = perm[:total], perm[total:]
    poison = torch.cat([torch.zeros(1, dtype=torch.long), unused])
    k_buf[poison] = float("nan")
    v_buf[poison] = float("nan")

    num_rows, max_context = len(seq_lens) + 2, max(seq_lens) + 8
    pick = torch.randint(0, len(poison), (num_rows, max_context), generator=gen)
    req_to_token = poison[pick].to(torch.int32)
    # Requests live in shuffled, non-contiguous rows of the table.
    rows = (torch.randperm(num_rows, generator=gen)[: len(seq_lens)]).to(torch.int64)
    offset = 0
    for row, n in zip(rows.tolist(), seq_lens):
        req_to_token[row, :n] = used[offset: offset + n].to(torch.int32)
        offset += n
    return k_buf.to(dtype), v_buf.to(dtype), req_to_token, rows


def reference(q, k_buf, v_buf, req_to_token, rows, prefix_lens, extend_lens, sm_scale):
    """Float64 causal attention: gather K/V by slot, mask by absolute position."""
    group = q.shape[1] // k_buf.shape[1]
    outs, start = [], 0
    for row, prefix, ext in zip(rows.tolist(), prefix_lens, extend_lens):
        slots = req_to_token[row, : prefix + ext].long()
        k = k_buf[slots].double().repeat_interleave(group, dim=1)
        v = v_buf[slots].double().repeat_interleave(group, dim=1)
        qb = q[start: start + ext].double()
        scores = torch.einsum("qhd,khd->hqk", qb, k) * sm_scale
        q_pos = prefix + torch.arange(ext, device=q.device)
        k_pos = torch.arange(prefix + ext, device=q.device)
        scores = scores.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
        start += ext
    return torch.cat(outs)


def assert_close(out, ref, dtype):
    assert out.dtype == dtype
    assert torch.isfinite(out).all()
    # fp32: full-precision dots under the interpreter and compiled alike (input_precision="ieee")
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


# Lengths straddle the extend tiles, which depend on fp32 row width (64x64 for
# D=32, 128x128 for D=64, 64x32 for D=96/128): a prefix of 0, an extend of 1,
# more than one query block, and prefixes spanning whole unmasked key blocks.
@pytest.mark.parametrize(
    "num_heads,num_kv_heads,head_dim,prefix_lens,extend_lens",
    [
        (4, 2, 64, [0, 150, 5], [130, 1, 20]),
        (4, 2, 128, [200, 0, 64], [3, 17, 65]),
        (4, 1, 96, [1, 130], [64, 7]),  # MQA, D not a power of two
        (2, 2, 64, [0], [1]),  # MHA, single token
        (2, 1, 32, [0, 100], [70, 3]),
        (4, 2, 64, [150, 0, 3], [64, 33, 1]),  # extends of <= 64 tokens: 64-row tiles at D=64 too
    ],
)
def test_extend_attention(num_heads, num_kv_heads, head_dim, prefix_lens, extend_lens):
    dev = kernel_device(tk._extend_kernel)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    k_buf, v_buf, req_to_token, rows = (t.to(dev) for t in make_pool(seq_lens, num_kv_heads, head_dim))
    q = torch.randn(sum(extend_lens), num_heads, head_dim, generator=torch.Generator().manual_seed(1)).to(dev)
    extend_start = torch.tensor([0] + extend_lens[:-1]).cumsum(0).to(dev)
    sm_scale = 1 / math.sqrt(head_dim)

    out = tk.extend_attention(
        q, k_buf, v_buf, req_to_token, rows,
        torch.tensor(prefix_lens, device=dev), torch.tensor(extend_lens, dtype=torch.int32, device=dev), extend_start,
        max(extend_lens), sm_scale,
    )
    ref = reference(q, k_buf, v_buf, req_to_token, rows, prefix_lens, extend_lens, sm_scale)
    assert out.shape == q.shape
    assert_close(out, ref, torch.float32)


def run_decode(seq_lens, num_heads, num_kv_heads, head_dim, dtype=torch.float32, max_seq_len=None):
    dev = kernel_device(tk._decode_stage1_kernel)
    k_buf, v_buf, req_to_token, rows = (t.to(dev) for t in make_pool(seq_lens, num_kv_heads, head_dim, dtype))
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=torch.Generator().manual_seed(1)).to(dev, dtype)
    sm_scale = 1 / math.sqrt(head_dim)
    out = tk.decode_attention(
        q, k_buf, v_buf, req_to_token, rows.to(torch.int32), torch.tensor(seq_lens, device=dev), sm_scale,
        max_seq_len,
    )
    prefix_lens = [n - 1 for n in seq_lens]
    ref = reference(q, k_buf, v_buf, req_to_token, rows, prefix_lens, [1] * len(seq_lens), sm_scale)
    assert out.shape == q.shape
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("max_seq_len", [None, 200])
def test_decode_attention(head_dim, max_seq_len):
    # With max_seq_len=200 there are 2 or 4 splits (by key block size), some of
    # them empty for the short requests; with None the table width decides.
    run_decode([1, 37, 200], num_heads=4, num_kv_heads=2, head_dim=head_dim, max_seq_len=max_seq_len)


def test_an_extend_as_one_decode_row_per_token_is_the_causal_extend():
    """What a small extend's CUDA graph runs (lmc/runtime/cuda_graph.py): each new token a decode row of its own on
    its request's table row, sequence length its position + 1, with every new token's K/V already in the pool. That
    equals causal extend attention (float64 reference), with padding rows after them as in a bucket; the pool's
    poisoned slots fail the test if any row reads past its length."""
    dev = kernel_device(tk._decode_stage1_kernel)
    prefix_lens, extend_lens = [150, 0, 20], [5, 3, 1]
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    k_buf, v_buf, req_to_token, rows = (t.to(dev) for t in make_pool(seq_lens, 2, 64))
    q = torch.randn(sum(extend_lens), 4, 64, generator=torch.Generator().manual_seed(3)).to(dev)
    tok_rows = torch.repeat_interleave(rows, torch.tensor(extend_lens, device=dev))
    positions = torch.cat([p + torch.arange(e) for p, e in zip(prefix_lens, extend_lens)]).to(dev)
    pad = 3  # a bucket's padding rows: row 0 at position 0 (whatever they read, their outputs are not used)
    q_pad = torch.cat([q, torch.zeros(pad, 4, 64, device=dev)])
    out = tk.decode_attention(q_pad, k_buf, v_buf, req_to_token,
                              torch.cat([tok_rows, torch.zeros(pad, dtype=torch.long, device=dev)]).to(torch.int32),
                              torch.cat([positions + 1, torch.ones(pad, dtype=torch.long, device=dev)]),
                              1 / math.sqrt(64), max(seq_lens) + 8)[:len(q)]
    ref = reference(q, k_buf, v_buf, req_to_token, rows, prefix_lens, extend_lens, 1 / math.sqrt(64))
    assert_close(out, ref, torch.float32)


class NoStage2:
    """Test double for the stage-2 kernel: launching it fails the test."""

    def __getitem__(self, grid):
        raise AssertionError("stage 2 launched for a single split")


def test_decode_attention_in_one_split_writes_the_output_in_stage_1(monkeypatch):
    # fp32 D=64 takes 128-key tiles: a length bound of 100 leaves one split, which stage 1 finishes alone.
    monkeypatch.setattr(tk, "_decode_stage2_kernel", NoStage2())
    run_decode([1, 37, 100], num_heads=4, num_kv_heads=2, head_dim=64, max_seq_len=100)


def test_decode_attention_split_k():
    # One long request: the grid splits its 1000 keys across several programs.
    run_decode([1000], num_heads=8, num_kv_heads=2, head_dim=128)


def test_decode_attention_fp16():
    run_decode([5, 300], num_heads=4, num_kv_heads=2, head_dim=64, dtype=torch.float16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="real shapes need a GPU")
@pytest.mark.parametrize("num_heads,num_kv_heads", [(32, 32), (32, 8)])  # llama-2-7b, llama-3-8b
def test_real_shapes_on_gpu(num_heads, num_kv_heads):
    for prefix_lens, extend_lens in (([0, 1200, 3000, 60], [1260, 60, 1, 500]),  # 128-row query tiles
                                      ([1200, 1200, 5, 0], [60, 1, 64, 33])):  # short extends: 64-row tiles
        check_real_shapes(num_heads, num_kv_heads, prefix_lens, extend_lens)


def check_real_shapes(num_heads, num_kv_heads, prefix_lens, extend_lens):
    dev, dtype, head_dim = torch.device("cuda"), torch.bfloat16, 128
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    k_buf, v_buf, req_to_token, rows = (t.to(dev) for t in make_pool(seq_lens, num_kv_heads, head_dim, dtype))
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(sum(extend_lens), num_heads, head_dim, generator=gen).to(dev, dtype)
    scale = head_dim ** -0.5
    out = tk.extend_attention(q, k_buf, v_buf, req_to_token, rows, torch.tensor(prefix_lens, device=dev),
                              torch.tensor(extend_lens, device=dev),
                              torch.tensor([0] + extend_lens[:-1], device=dev).cumsum(0), max(extend_lens), scale)
    ref = reference(q, k_buf, v_buf, req_to_token, rows, prefix_lens, extend_lens, scale)
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)
    qd = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen).to(dev, dtype)
    out = tk.decode_attention(qd, k_buf, v_buf, req_to_token, rows, torch.tensor(seq_lens, device=dev), scale)
    ref = reference(qd, k_buf, v_buf, req_to_token, rows, [n - 1 for n in seq_lens], [1] * len(seq_lens), scale)
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)


def share_prefix(req_to_token, rows, prefix_len):
    """Point positions [0, prefix_len) of every request's row at the first request's slots: the batch shares that
    prefix slot for slot, as requests matched to one radix-cache path do. The other requests' own prefix slots are
    poisoned, so a read through a row other than the first's shows."""
    first = req_to_token[rows[0], :prefix_len].clone()
    return first, [req_to_token[r, :prefix_len].clone() for r in rows[1:].tolist()]


def run_shared_prefix_decode(seq_lens, prefix_len, num_heads, num_kv_heads, head_dim, dtype=torch.float32,
                             max_seq_len=None, on_device=False):
    """on_device: the prefix length as an int32 device tensor, as CUDA graphs pass it (launch sized for any)."""
    dev = kernel_device(tk._decode_prefix_kernel)
    k_buf, v_buf, req_to_token, rows = make_pool(seq_lens, num_kv_heads, head_dim, dtype)
    first, own = share_prefix(req_to_token, rows, prefix_len)
    for r, slots in zip(rows[1:].tolist(), own):
        k_buf[slots.long()] = float("nan")
        v_buf[slots.long()] = float("nan")
        req_to_token[r, :prefix_len] = first
    k_buf, v_buf, req_to_token, rows = (t.to(dev) for t in (k_buf, v_buf, req_to_token, rows))
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=torch.Generator().manual_seed(1)).to(dev, dtype)
    sm_scale = 1 / math.sqrt(head_dim)
    shared = torch.tensor([prefix_len], dtype=torch.int32, device=dev) if on_device else prefix_len
    out = tk.decode_attention(q, k_buf, v_buf, req_to_token, rows, torch.tensor(seq_lens, device=dev), sm_scale,
                              max_seq_len, shared_prefix=shared)
    ref = reference(q, k_buf, v_buf, req_to_token, rows, [n - 1 for n in seq_lens], [1] * len(seq_lens), sm_scale)
    assert out.shape == q.shape
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,seq_lens,prefix_len", [
    (4, 2, 64, [150, 141, 170, 300], 140),  # GQA: 8 query rows in one 64-row tile; prefix split over programs
    (2, 2, 128, [65, 66], 64),  # MHA, fp32 D=128 (narrow tiles); each request's own keys a single one
    (4, 1, 96, [40, 35, 90], 34),  # MQA, D not a power of two, a prefix not a whole key block
])
def test_decode_attention_shared_prefix(num_heads, num_kv_heads, head_dim, seq_lens, prefix_len):
    run_shared_prefix_decode(seq_lens, prefix_len, num_heads, num_kv_heads, head_dim)


def test_decode_attention_shared_prefix_many_requests():
    # 40 requests x 4 heads of a group: 160 query rows, so 128-row prefix tiles, the second one partial.
    lens = [97 + (7 * i) % 23 for i in range(40)]
    run_shared_prefix_decode(lens, 96, num_heads=8, num_kv_heads=2, head_dim=64)


def test_decode_attention_shared_prefix_with_splits():
    # Few requests and a wide length bound: their own keys split several ways (some splits empty) besides the
    # prefix's splits, all merged by stage 2.
    run_shared_prefix_decode([400, 260], 250, num_heads=4, num_kv_heads=2, head_dim=64, max_seq_len=600)


@pytest.mark.parametrize("prefix_len", [0, 140])
def test_decode_attention_shared_prefix_read_on_the_device(prefix_len):
    # A CUDA graph's launch: sized for any prefix below the bound, the length read from a device int (0: no prefix).
    run_shared_prefix_decode([150, 141, 170, 300], prefix_len, num_heads=4, num_kv_heads=2, head_dim=64,
                             max_seq_len=320, on_device=True)


def test_decode_attention_shared_prefix_fp16():
    run_shared_prefix_decode([130, 200, 129], 128, num_heads=4, num_kv_heads=2, head_dim=64, dtype=torch.float16)


def test_decode_attention_rejects_a_shared_prefix_past_the_bound():
    dev = kernel_device(tk._decode_prefix_kernel)
    k_buf, v_buf, req_to_token, rows = (t.to(dev) for t in make_pool([10], 2, 64))
    q = torch.randn(1, 2, 64, device=dev)
    with pytest.raises(ValueError, match="shared_prefix"):
        tk.decode_attention(q, k_buf, v_buf, req_to_token, rows, torch.tensor([10], device=dev), 0.1, 10,
                            shared_prefix=10)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="real shapes need a GPU")
@pytest.mark.parametrize("num_heads,num_kv_heads", [(32, 32), (32, 8)])  # llama-2-7b, llama-3-8b
def test_shared_prefix_decode_real_shapes_on_gpu(num_heads, num_kv_heads):
    # gpu_bench's few-shot decode: 128 requests on one 1,200-token prefix, each with 60-68 tokens of its own.
    dev, dtype, head_dim, prefix = torch.device("cuda"), torch.bfloat16, 128, 1200
    seq_lens = [prefix + 60 + i % 9 for i in range(128)]
    k_buf, v_buf, req_to_token, rows = make_pool(seq_lens, num_kv_heads, head_dim, dtype)
    first, _ = share_prefix(req_to_token, rows, prefix)
    req_to_token[rows, :prefix] = first
    k_buf, v_buf, req_to_token, rows = (t.to(dev) for t in (k_buf, v_buf, req_to_token, rows))
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=torch.Generator().manual_seed(2)).to(dev, dtype)
    lens, scale = torch.tensor(seq_lens, device=dev), head_dim ** -0.5
    cascade = tk.decode_attention(q, k_buf, v_buf, req_to_token, rows, lens, scale, shared_prefix=prefix)
    plain = tk.decode_attention(q, k_buf, v_buf, req_to_token, rows, lens, scale)
    ref = reference(q, k_buf, v_buf, req_to_token, rows, [n - 1 for n in seq_lens], [1] * len(seq_lens), scale)
    torch.testing.assert_close(cascade.double(), ref, rtol=2e-2, atol=2e-2)
    assert (cascade.double() - ref).norm() <= 1.5 * (plain.double() - ref).norm() + 1e-6  # no worse than bf16's own
