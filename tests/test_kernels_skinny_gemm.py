"""The decode GEMM (lmc/runtime/kernels/skinny_gemm.py) against float64 products, its epilogues (SiLU-mul; RoPE
and the KV write) against the kernels they replace, and kernels.linear's dispatch. Under Triton's interpreter on a
machine without a GPU (fp32 and fp16: the interpreter's bf16 tl.dot is broken), compiled in bf16 at the models'
shapes on a GPU."""
from triton_device import kernel_device  # noqa: F401  (first: sets TRITON_INTERPRET where there is no GPU)

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from lmc.runtime import kernels  # noqa: E402
from lmc.runtime.kernels import skinny_gemm as sg  # noqa: E402


def rand(*shape, dtype, dev, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dev, dtype)


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
@pytest.mark.parametrize("m,n,k,config", [(1, 48, 64, (16, 32, 4, 2)), (5, 70, 96, (32, 64, 4, 2)),
                                          (17, 33, 128, (16, 64, 4, 3)), (64, 40, 300, (16, 128, 4, 2))])
def test_skinny_gemm_matches_a_float64_product(dtype, tol, m, n, k, config):
    """Partial N and K tiles (70, 33, 300), M past one 16-row tile (17, 64), and every output written."""
    dev = kernel_device(sg._skinny_gemm_kernel)
    x, w = rand(m, k, dtype=dtype, dev=dev, seed=0), rand(n, k, dtype=dtype, dev=dev, seed=1)
    y = sg.skinny_gemm(x, w, config)
    assert y.shape == (m, n) and y.dtype == dtype and torch.isfinite(y).all()
    assert rel(y, x.double() @ w.double().T) < tol


@pytest.mark.parametrize("m,n,k,config", [(1, 48, 64, (16, 32, 4, 2, 2)), (5, 70, 200, (32, 32, 4, 2, 3)),
                                          (17, 33, 128, (16, 32, 4, 2, 4)), (3, 40, 96, (16, 64, 4, 2, 8))])
def test_split_k_matches_a_float64_product_and_leaves_its_counters_zero(m, n, k, config):
    """Split K: a partial last split (200 = 3 x 64 + 8), M past one tile (17), more splits asked than K blocks
    (96 has 2 blocks of 64: 2 splits run). Twice in a row: the second launch finds the tile counters reset."""
    dev = kernel_device(sg._skinny_gemm_kernel)
    for seed in (0, 2):
        x, w = rand(m, k, dtype=torch.float32, dev=dev, seed=seed), rand(n, k, dtype=torch.float32, dev=dev,
                                                                           seed=seed + 1)
        y = sg.skinny_gemm(x, w, config)
        assert y.shape == (m, n) and torch.isfinite(y).all()
        assert rel(y, x.double() @ w.double().T) < 1e-5
        assert not sg._counters[y.device].any()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 3e-3)])
@pytest.mark.parametrize("m,inter,k,config", [(1, 24, 64, (32, 32, 4, 2)), (5, 70, 96, (64, 64, 4, 2)),
                                              (17, 33, 128, (32, 64, 4, 3)), (64, 40, 300, (32, 128, 4, 2))])
def test_gated_product_is_silu_mul_of_the_float64_product(dtype, tol, m, inter, k, config):
    """The SiLU-mul epilogue: w [2I, K] as the MLP's gate_up (gate rows, then up rows); partial output tiles (70 and
    33 outputs over 32- and 16-output halves), partial K (300), M past one tile (17, 64), every output written."""
    dev = kernel_device(sg._skinny_gemm_kernel)
    x, w = rand(m, k, dtype=dtype, dev=dev, seed=0), rand(2 * inter, k, dtype=dtype, dev=dev, seed=1)
    y = sg.skinny_gemm(x, w, config, gated=True)
    gate_up = x.double() @ w.double().T
    want = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    assert y.shape == (m, inter) and y.dtype == dtype and torch.isfinite(y).all()
    assert rel(y, want) < tol


def _rope_case(m, hq, hkv, hd, k, dtype, dev, seed):
    """x, the fused QKV weight, cos/sin at random positions, distinct slots and two empty caches."""
    x, w = rand(m, k, dtype=dtype, dev=dev, seed=seed) * 0.3, rand((hq + 2 * hkv) * hd, k, dtype=dtype, dev=dev,
                                                                  seed=seed + 1) * 0.1
    angle = torch.rand(m, hd // 2, generator=torch.Generator().manual_seed(seed)) * 100
    emb = torch.cat([angle, angle], -1)
    slots = torch.randperm(4 * m + 8, generator=torch.Generator().manual_seed(seed))[:m].to(dev)
    cache = torch.zeros(4 * m + 8, hkv, hd, dtype=dtype, device=dev)
    return x, w, emb.cos().to(dev, dtype), emb.sin().to(dev, dtype), slots, cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,hq,hkv,hd,config", [(1, 4, 2, 64, (32, 32, 4, 2)), (5, 2, 1, 64, (64, 64, 4, 3)),
                                                (17, 4, 4, 32, (32, 32, 4, 2)), (3, 8, 2, 128, (32, 128, 4, 2))])
def test_rope_epilogue_equals_the_gemm_then_rope_q_write_kv(dtype, m, hq, hkv, hd, config):
    """The QKV GEMM with RoPE and the KV write in its epilogue gives what the plain product and
    triton_ops.rope_q_write_kv give (it rounds where they round): q, and k and v at the tokens' slots only. Tiles of
    two 16- and 32-row halves, one or several programs per half head, GQA and MHA, M past a tile.
    Within an ulp or two, not bit for bit: the two kernels' tiles hold the weight rows in different orders, and a
    dot may sum a tile's products in another order for each (numpy's matmul under the interpreter on some CPUs: an
    fp32 ulp in v, which no rotation touches; compiled kernels contracting into FMAs differently on the GPU), and an
    ulp of the rotation's operands is large against the small results of its cancellations (H100: up to 1.5e-4
    absolute in fp16 on outputs of order 0.1). bf16 at real shapes, what the GPU runs, is bit for bit
    (test_rope_epilogue_equals_the_two_kernels_on_gpu)."""
    from lmc.runtime.kernels import triton_ops

    dev = kernel_device(sg._skinny_gemm_kernel)
    x, w, cos, sin, slots, cache = _rope_case(m, hq, hkv, hd, 96, dtype, dev, seed=m)
    kc, vc, kc2, vc2 = cache.clone(), cache.clone(), cache.clone(), cache.clone()
    q = sg.skinny_gemm_rope(x, w, config, cos, sin, hq, hkv, hd, kc, vc, slots)
    want = triton_ops.rope_q_write_kv(sg.skinny_gemm(x, w, config), cos, sin, hq, hkv, hd, kc2, vc2, slots)
    assert q.shape == (m, hq, hd) and kc[slots].abs().sum() > 0 and vc[slots].abs().sum() > 0
    others = torch.ones(len(cache), dtype=torch.bool, device=dev)
    others[slots] = False
    assert not kc[others].any() and not vc[others].any()  # nothing written outside the tokens' slots
    eps = torch.finfo(dtype).eps
    for got, ref in ((q, want), (kc[slots], kc2[slots]), (vc[slots], vc2[slots])):
        torch.testing.assert_close(got, ref, rtol=2 * eps, atol=4 * eps * ref.abs().max().item())
        torch.testing.assert_close(kc, kc2, rtol=2 * eps, atol=4 * eps * kc2.abs().max().item())


def test_rope_epilogue_takes_only_tiles_within_half_a_head():
    assert sg.rope_tile_fits((32, 128, 4, 4), 128) and sg.rope_tile_fits((64, 512, 4, 3), 128)
    assert not sg.rope_tile_fits((32, 128, 4, 4, 2), 128)  # split K: no epilogue
    assert not sg.rope_tile_fits((256, 64, 4, 3), 128) and not sg.rope_tile_fits((64, 64, 4, 3), 48)
    # the decode table's QKV tiles of both models take it, where it measured faster: llama-2-7b up to batch 8
    assert sg.rope_config_for(8, 12288, 4096, 128) == sg.config_for(8, 12288, 4096)
    assert sg.rope_config_for(9, 12288, 4096, 128) is None and sg.rope_config_for(16, 6144, 4096, 128) is not None
    assert sg.rope_config_for(1, 12288, 4096, 40) is None  # half a head of 20 rows: 16-row halves do not fit it
    dev = kernel_device(sg._skinny_gemm_kernel)
    x, w, cos, sin, slots, cache = _rope_case(2, 2, 1, 64, 32, torch.float32, dev, seed=0)
    with pytest.raises(ValueError, match="fits the heads"):
        sg.skinny_gemm_rope(x, w[:-1], (32, 32, 4, 2), cos, sin, 2, 1, 64, cache, cache.clone(), slots)
    with pytest.raises(ValueError, match="k/v caches"):
        sg.skinny_gemm_rope(x, w, (32, 32, 4, 2), cos, sin, 2, 1, 64, cache[:, :, :32], cache.clone(), slots)


def test_skinny_gemm_rejects_what_it_cannot_serve():
    dev = kernel_device(sg._skinny_gemm_kernel)
    w = torch.zeros(8, 32, device=dev)
    with pytest.raises(ValueError, match="unit stride"):
        sg.skinny_gemm(torch.zeros(2, 16, device=dev), w, (16, 32, 4, 2))
    with pytest.raises(ValueError, match="at most"):
        sg.skinny_gemm(torch.zeros(sg.MAX_M + 1, 32, device=dev), w, (16, 32, 4, 2))
    with pytest.raises(ValueError, match="no split K"):
        sg.skinny_gemm(torch.zeros(2, 32, device=dev), w, (32, 32, 4, 2, 2), gated=True)
    with pytest.raises(ValueError, match=r"w \[2I, K\]"):
        sg.skinny_gemm(torch.zeros(2, 32, device=dev), torch.zeros(7, 32, device=dev), (32, 32, 4, 2), gated=True)


def test_config_table_serves_only_decode_batches():
    assert sg.config_for(1, 12288, 4096) is not None  # llama-2-7b qkv at batch 1
    assert sg.config_for(sg.MAX_M + 1, 12288, 4096) is None and sg.config_for(0, 12288, 4096) is None
    assert sg.config_for(1, 12345, 4096) is None  # an unmeasured shape stays on cuBLAS
    # SmolLM2's linears at batch <= 16 (measured at 1 and 4), each on the skinny GEMM; its lm-head stays on cuBLAS
    assert all(sg.config_for(m, n, k) for m in (1, 4, 16) for n, k in ((960, 576), (576, 576), (3072, 576),
                                                                      (576, 1536)))
    assert sg.config_for(17, 960, 576) is None and sg.config_for(1, 49152, 576) is None
    assert sg.rope_config_for(16, 960, 576, 64) is not None and sg.config_for(4, 3072, 576, gated=True) is not None
    # the gated product only where it measured faster: llama-3-8b's gate_up, not llama-2-7b's
    assert sg.config_for(8, 28672, 4096, gated=True) is not None and sg.config_for(8, 22016, 4096, gated=True) is None
    assert all(len(c) == 4 and c[0] >= 32 for c in sg.GATED_CONFIGS.values())  # unsplit, two 16-row halves at least


def test_linear_falls_back_to_f_linear_off_the_gpu():
    x, w, b = torch.randn(3, 16), torch.randn(8, 16), torch.randn(8)
    assert torch.equal(kernels.linear(x, w, b), F.linear(x, w, b))
    assert torch.equal(kernels.linear(x, w), F.linear(x, w))
    assert torch.equal(kernels.linear_silu_mul(x, w), kernels.silu_mul(F.linear(x, w)))
    x, w, cos, sin, slots, cache = _rope_case(3, 2, 1, 64, 16, torch.float32, torch.device("cpu"), seed=3)
    kc, vc, kc2, vc2 = cache.clone(), cache.clone(), cache.clone(), cache.clone()
    q = kernels.linear_rope_q_write_kv(x, w, cos, sin, 2, 1, 64, kc, vc, slots)
    want = kernels.rope_q_write_kv(F.linear(x, w), cos, sin, 2, 1, 64, kc2, vc2, slots)
    assert torch.equal(q, want) and torch.equal(kc, kc2) and torch.equal(vc, vc2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="real shapes need a GPU")
@pytest.mark.parametrize("shape", ["llama-2-7b", "llama-3-8b", "smollm2-135m"])
@pytest.mark.parametrize("m", [1, 32, 64, 65])
def test_linears_at_real_shapes_on_gpu(shape, m):
    """kernels.linear at the model's shapes in bf16 (the skinny kernel where the table says, cuBLAS elsewhere and
    past MAX_M) stays within bf16 rounding of cuBLAS."""
    from lmc.runtime.model.loader import DUMMY_SHAPES

    c, dev, dt = DUMMY_SHAPES[shape], torch.device("cuda"), torch.bfloat16
    d, inter, vocab = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    hd = d // c["num_attention_heads"]
    for n, k in [((c["num_attention_heads"] + 2 * c["num_key_value_heads"]) * hd, d), (d, d), (2 * inter, d),
                 (d, inter), (vocab, d)]:
        x, w = rand(m, k, dtype=dt, dev=dev, seed=4) * 0.1, rand(n, k, dtype=dt, dev=dev, seed=5) * 0.1
        assert rel(kernels.linear(x, w), F.linear(x, w)) < 1e-2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="real shapes need a GPU")
@pytest.mark.parametrize("shape,m", [(s, m) for s in ("llama-2-7b", "llama-3-8b") for m in (1, 8, 16, 32)]
                         + [("smollm2-135m", m) for m in (1, 4, 16)])
def test_gated_product_equals_the_two_kernels_on_gpu(shape, m, monkeypatch):
    """The gated product at the gate_up shapes in bf16 (the gated table's tile, else the plain one's) against the
    product and silu_mul as two kernels: the epilogue rounds where they round, so at most an ulp apart, and both
    within bf16 rounding of a float64 reference; kernels.linear_silu_mul takes whichever the tables say."""
    from lmc.runtime.model.loader import DUMMY_SHAPES

    c, dev, dt = DUMMY_SHAPES[shape], torch.device("cuda"), torch.bfloat16
    d, inter = c["hidden_size"], c["intermediate_size"]
    cfg = sg.config_for(m, 2 * inter, d, gated=True) or sg.config_for(m, 2 * inter, d)
    x, w = rand(m, d, dtype=dt, dev=dev, seed=11) * 0.1, rand(2 * inter, d, dtype=dt, dev=dev, seed=12) * 0.1
    fused = sg.skinny_gemm(x, w, cfg, gated=True)
    monkeypatch.setattr(kernels, "FUSE_SILU_MUL", False)
    apart = kernels.linear_silu_mul(x, w)
    gate_up = x.double() @ w.double().T
    want = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    assert fused.shape == apart.shape == (m, inter)
    assert rel(fused, apart) < 4e-3 and rel(fused, want) < 1e-2
    monkeypatch.setattr(kernels, "FUSE_SILU_MUL", True)
    assert torch.equal(kernels.linear_silu_mul(x, w), fused if sg.config_for(m, 2 * inter, d, gated=True) else apart)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="real shapes need a GPU")
@pytest.mark.parametrize("shape", ["llama-2-7b", "llama-3-8b", "smollm2-135m"])
@pytest.mark.parametrize("m", [1, 8])
def test_rope_epilogue_equals_the_two_kernels_on_gpu(shape, m, monkeypatch):
    """The QKV GEMM with RoPE and the KV write in its epilogue, compiled at the models' shapes in bf16 with the
    table's tile: bit for bit the plain product and rope_q_write_kv (what kernels.linear_rope_q_write_kv runs with
    FUSE_ROPE off)."""
    from lmc.runtime.model.loader import DUMMY_SHAPES

    c, dev, dt = DUMMY_SHAPES[shape], torch.device("cuda"), torch.bfloat16
    hq, hkv, d = c["num_attention_heads"], c["num_key_value_heads"], c["hidden_size"]
    hd = d // hq
    x, w, cos, sin, slots, cache = _rope_case(m, hq, hkv, hd, d, dt, dev, seed=20 + m)
    kc, vc, kc2, vc2 = cache.clone(), cache.clone(), cache.clone(), cache.clone()
    assert sg.rope_config_for(m, w.shape[0], d, hd) is not None
    q = kernels.linear_rope_q_write_kv(x, w, cos, sin, hq, hkv, hd, kc, vc, slots)
    monkeypatch.setattr(kernels, "FUSE_ROPE", False)
    want = kernels.linear_rope_q_write_kv(x, w, cos, sin, hq, hkv, hd, kc2, vc2, slots)
    assert torch.equal(q, want) and torch.equal(kc, kc2) and torch.equal(vc, vc2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_split_k_replayed_in_a_cuda_graph_gives_the_eager_result():
    """The counters come from the warm-up and the kernel resets them: each replay on new inputs equals an eager
    launch exactly (the partials are summed in split order, whichever split finishes last)."""
    dev, dt, cfg = torch.device("cuda"), torch.bfloat16, (64, 128, 4, 4, 4)
    x, w = rand(1, 4096, dtype=dt, dev=dev, seed=6), rand(4096, 4096, dtype=dt, dev=dev, seed=7)
    sg.skinny_gemm(x, w, cfg)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = sg.skinny_gemm(x, w, cfg)
    for seed in (8, 9, 10):
        x.copy_(rand(1, 4096, dtype=dt, dev=dev, seed=seed))
        g.replay()
        assert torch.equal(y, sg.skinny_gemm(x, w, cfg))
        assert rel(y, x.double() @ w.double().T) < 1e-2
