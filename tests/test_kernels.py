"""The fused kernels (lmc/runtime/kernels/triton_ops.py) against their torch definitions (kernels/reference.py)
and a float64 computation. On a machine without a GPU they run under Triton's interpreter at small shapes; on a
GPU, compiled, at the same shapes, and test_real_shapes_on_gpu adds the llama-2-7b and llama-3-8b shapes."""
from triton_device import kernel_device  # noqa: F401  (first: sets TRITON_INTERPRET where there is no GPU)

import pytest
import torch

pytest.importorskip("triton")

from lmc.runtime.kernels import reference  # noqa: E402
from lmc.runtime.kernels import triton_ops as ops  # noqa: E402

ULP = {torch.float32: 2.0 ** -23, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}


def rand(*shape, dtype, dev, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dev, dtype)


def assert_within_ulps(out, ref, dtype, ulps=2):
    """|out - ref| <= ulps * ulp(dtype) * max(|ref|, 1e-3): the kernel rounds where the reference does."""
    assert out.dtype == ref.dtype == dtype and out.shape == ref.shape
    assert torch.isfinite(out).all()
    o, r = out.double(), ref.double()
    bound = ulps * ULP[dtype] * r.abs().clamp_min(1e-3) + (1e-6 if dtype == torch.float32 else 0.0)
    bad = (o - r).abs() > bound
    assert not bad.any(), f"{int(bad.sum())} of {bad.numel()} elements off, worst {(o - r).abs().max().item():.3g}"


def rms_norm_f64(x, w, eps):
    x = x.double()
    return w.double() * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,dim", [(1, 64), (7, 96), (33, 256)])  # 96: not a power of two
def test_rms_norm(dtype, tokens, dim):
    dev = kernel_device(ops._rms_norm_kernel)
    x, w = rand(tokens, dim, dtype=dtype, dev=dev, seed=0, scale=3), rand(dim, dtype=dtype, dev=dev, seed=1)
    out = ops.rms_norm(x, w, 1e-5)
    assert_within_ulps(out, reference.rms_norm(x, w, 1e-5), dtype)
    torch.testing.assert_close(out.double(), rms_norm_f64(x, w, 1e-5), rtol=4 * ULP[dtype], atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,dim", [(1, 64), (9, 160)])
def test_add_rms_norm_returns_the_residual_stream_and_its_norm(dtype, tokens, dim):
    dev = kernel_device(ops._rms_norm_kernel)
    res, x = rand(tokens, dim, dtype=dtype, dev=dev, seed=2), rand(tokens, dim, dtype=dtype, dev=dev, seed=3)
    w = rand(dim, dtype=dtype, dev=dev, seed=4)
    h, out = ops.add_rms_norm(res, x, w, 1e-6)
    ref_h, ref_out = reference.add_rms_norm(res, x, w, 1e-6)
    assert torch.equal(h, ref_h)  # one rounded add, as torch does it
    assert_within_ulps(out, ref_out, dtype)
    assert res.data_ptr() != h.data_ptr()  # inputs are left alone
    with pytest.raises(ValueError, match="differ in shape"):
        ops.add_rms_norm(res[:, :-1].contiguous(), x, w, 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,inter", [(1, 128), (5, 1500)])  # 1500: two blocks, the second partial
def test_silu_mul(dtype, tokens, inter):
    dev = kernel_device(ops._silu_mul_kernel)
    gu = rand(tokens, 2 * inter, dtype=dtype, dev=dev, seed=5, scale=4)
    out = ops.silu_mul(gu)
    assert out.shape == (tokens, inter)
    assert_within_ulps(out, reference.silu_mul(gu), dtype)
    g, u = gu.double().chunk(2, dim=-1)
    torch.testing.assert_close(out.double(), g * torch.sigmoid(g) * u, rtol=3 * ULP[dtype], atol=1e-6)


def rope_tables(max_pos, dim, dtype, dev):
    inv = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    freqs = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dev, dtype), emb.sin().to(dev, dtype)


def rope_f64(x, cos, sin):
    """Rotation of each pair (x[i], x[i + D/2]) by its angle, in float64."""
    x, c, s = x.double(), cos.double()[:, None, :], sin.double()[:, None, :]
    half = x.shape[-1] // 2
    lo, hi = x[..., :half], x[..., half:]
    return torch.cat((lo * c[..., :half] - hi * s[..., :half], hi * c[..., half:] + lo * s[..., half:]), dim=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,dim", [(4, 2, 64), (3, 1, 96), (2, 2, 32)])  # GQA, MQA with D/2 = 48, MHA
def test_rope_qk(dtype, hq, hkv, dim):
    dev = kernel_device(ops._rope_qk_kernel)
    tokens = 11
    qkv = rand(tokens, (hq + 2 * hkv) * dim, dtype=dtype, dev=dev, seed=6)
    cos_t, sin_t = rope_tables(512, dim, dtype, dev)
    pos = torch.randint(0, 512, (tokens,), generator=torch.Generator().manual_seed(7)).to(dev)
    cos, sin = cos_t[pos], sin_t[pos]
    q, k, v = ops.rope_qk(qkv, cos, sin, hq, hkv, dim)
    rq, rk, rv = reference.rope_qk(qkv, cos, sin, hq, hkv, dim)
    assert q.shape == (tokens, hq, dim) and k.shape == (tokens, hkv, dim) and q.is_contiguous()
    assert_within_ulps(q, rq, dtype)
    assert_within_ulps(k, rk, dtype)
    assert torch.equal(v, rv)
    tol = 1e-6 if dtype == torch.float32 else 8 * ULP[dtype]
    torch.testing.assert_close(q.double(), rope_f64(qkv[:, :hq * dim].view(tokens, hq, dim), cos, sin),
                               rtol=tol, atol=tol)


def test_rope_qk_rejects_a_mismatched_layout():
    dev = kernel_device(ops._rope_qk_kernel)
    qkv = torch.zeros(3, 8 * 16, device=dev)
    cos = torch.zeros(3, 16, device=dev)
    with pytest.raises(ValueError, match="qkv must be"):
        ops.rope_qk(qkv, cos, cos, 4, 1, 16)  # (4 + 2) * 16 != 128
    with pytest.raises(ValueError, match="even head_dim"):
        ops.rope_qk(torch.zeros(3, 6 * 15, device=dev), cos[:, :15], cos[:, :15], 4, 1, 15)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="real shapes need a GPU")
@pytest.mark.parametrize("shape", ["llama-2-7b", "llama-3-8b"])
@pytest.mark.parametrize("tokens", [1, 64, 4096])
def test_real_shapes_on_gpu(shape, tokens):
    """The dispatching entry points (kernels/__init__.py) at the model's shapes in bf16: the kernels run there."""
    from lmc.runtime import kernels
    from lmc.runtime.model.loader import DUMMY_SHAPES

    c, dev, dt = DUMMY_SHAPES[shape], torch.device("cuda"), torch.bfloat16
    d, hq, hkv, inter = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["intermediate_size"]
    hd = d // hq
    res, x, w = (rand(tokens, d, dtype=dt, dev=dev, seed=s) for s in (10, 11, 12))
    h, out = kernels.add_rms_norm(res, x, w[0], 1e-5)
    ref_h, ref_out = reference.add_rms_norm(res, x, w[0], 1e-5)
    assert torch.equal(h, ref_h)
    assert_within_ulps(out, ref_out, dt)
    gu = rand(tokens, 2 * inter, dtype=dt, dev=dev, seed=13, scale=3)
    assert_within_ulps(kernels.silu_mul(gu), reference.silu_mul(gu), dt)
    qkv = rand(tokens, (hq + 2 * hkv) * hd, dtype=dt, dev=dev, seed=14)
    cos_t, sin_t = rope_tables(8192, hd, dt, dev)
    pos = torch.randint(0, 8192, (tokens,), device=dev)
    got, want = kernels.rope_qk(qkv, cos_t[pos], sin_t[pos], hq, hkv, hd), \
        reference.rope_qk(qkv, cos_t[pos], sin_t[pos], hq, hkv, hd)
    for a, b in zip(got, want):
        assert_within_ulps(a, b, dt)
    k_cache, v_cache = (torch.zeros(tokens + 7, hkv, hd, dtype=dt, device=dev) for _ in range(2))
    slots = torch.randperm(tokens + 7, device=dev)[:tokens]
    q = kernels.rope_q_write_kv(qkv, cos_t[pos], sin_t[pos], hq, hkv, hd, k_cache, v_cache, slots)
    assert torch.equal(q, got[0]) and torch.equal(k_cache[slots], got[1]) and torch.equal(v_cache[slots], got[2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hkv,dim", [(4, 2, 64), (3, 1, 96)])
def test_rope_q_write_kv_writes_only_the_new_slots(dtype, hq, hkv, dim):
    dev = kernel_device(ops._rope_qk_kernel)
    tokens, num_slots = 9, 40
    qkv = rand(tokens, (hq + 2 * hkv) * dim, dtype=dtype, dev=dev, seed=8)
    cos_t, sin_t = rope_tables(256, dim, dtype, dev)
    g = torch.Generator().manual_seed(9)
    pos = torch.randint(0, 256, (tokens,), generator=g).to(dev)
    slots = (torch.randperm(num_slots - 1, generator=g)[:tokens] + 1).to(dev)
    k_cache = torch.full((num_slots, hkv, dim), float("nan"), dtype=dtype, device=dev)
    v_cache = k_cache.clone()
    q = ops.rope_q_write_kv(qkv, cos_t[pos], sin_t[pos], hq, hkv, dim, k_cache, v_cache, slots)
    rq, rk, rv = reference.rope_qk(qkv, cos_t[pos], sin_t[pos], hq, hkv, dim)
    assert_within_ulps(q, rq, dtype)
    assert_within_ulps(k_cache[slots], rk, dtype)
    assert torch.equal(v_cache[slots], rv)
    untouched = torch.ones(num_slots, dtype=torch.bool, device=dev)
    untouched[slots] = False
    assert torch.isnan(k_cache[untouched]).all() and torch.isnan(v_cache[untouched]).all()
    with pytest.raises(ValueError, match="caches must be"):
        ops.rope_q_write_kv(qkv, cos_t[pos], sin_t[pos], hq, hkv, dim, k_cache[:, :, :-1], v_cache, slots)


def test_rope_qk_long_extend_runs_one_program_per_token():
    """Past _ROPE_SPLIT_MAX_TOKENS a token's heads stay in one program: the same numbers as the split launch."""
    dev = kernel_device(ops._rope_qk_kernel)
    tokens, hq, hkv, dim = ops._ROPE_SPLIT_MAX_TOKENS + 1, 2, 1, 16
    qkv = rand(tokens, (hq + 2 * hkv) * dim, dtype=torch.float32, dev=dev, seed=15)
    cos_t, sin_t = rope_tables(512, dim, torch.float32, dev)
    pos = torch.randint(0, 512, (tokens,), generator=torch.Generator().manual_seed(16)).to(dev)
    got = ops.rope_qk(qkv, cos_t[pos], sin_t[pos], hq, hkv, dim)
    split = ops.rope_qk(qkv[:2], cos_t[pos[:2]], sin_t[pos[:2]], hq, hkv, dim)
    for a, b, r in zip(got, split, reference.rope_qk(qkv, cos_t[pos], sin_t[pos], hq, hkv, dim)):
        assert_within_ulps(a, r, torch.float32)
        assert torch.equal(a[:2], b)


@pytest.mark.parametrize("gather", [True, False])  # False: an extend graph's, whose ids were copied in
@pytest.mark.parametrize("n,padding", [(1, 0), (5, 3), (300, 20)])  # 300 + 20: past one 256-row block
def test_decode_inputs_gathers_ids_and_writes_only_the_new_slots(n, padding, gather):
    """A decode graph's first kernel against its torch ops: ids from the token buffer at the rows, sequence lengths
    positions + 1, the slots written into the table at (row, position) and nowhere else; padding rows (the dummy
    row 0 at position 0, slot 0) all write the same entry. Outputs poisoned first: every row is written. Without
    the gather the ids stay as they were."""
    dev = kernel_device(ops._decode_inputs_kernel)
    g = torch.Generator().manual_seed(n)
    num_rows, ctx = n + 4, 64
    rows = torch.cat([torch.randperm(num_rows - 1, generator=g)[:n] + 1, torch.zeros(padding, dtype=torch.long)])
    positions = torch.cat([torch.randint(0, ctx, (n,), generator=g), torch.zeros(padding, dtype=torch.long)])
    slots = torch.cat([torch.randint(1, 10_000, (n,), generator=g), torch.zeros(padding, dtype=torch.long)])
    token_buf = torch.randint(0, 32_000, (num_rows,), generator=g)
    table = torch.randint(0, 10_000, (num_rows, ctx), generator=g, dtype=torch.int32)
    table[0] = 0  # the dummy row stays zeros
    args = [t.to(dev) for t in (token_buf, table, rows, positions, slots)]
    ids, seq = torch.full((n + padding,), -7, device=dev), torch.full((n + padding,), -7, dtype=torch.int32, device=dev)
    ref_args = [t.clone() for t in args]
    ref_ids, ref_seq = ids.clone(), seq.clone()
    if not gather:
        args[0] = ref_args[0] = None
    ops.decode_inputs(*args, ids, seq)
    reference.decode_inputs(*ref_args, ref_ids, ref_seq)
    assert torch.equal(ids, ref_ids) and torch.equal(seq, ref_seq) and torch.equal(args[1], ref_args[1])
    assert torch.equal(ids.cpu(), token_buf[rows] if gather else torch.full_like(ids.cpu(), -7))
    assert int((args[1].cpu() != table).sum()) <= n
