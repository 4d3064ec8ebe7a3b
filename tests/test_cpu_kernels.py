"""The C++ CPU elementwise kernels (lmc/runtime/attention/cpu_kernel.py), which kernels/__init__.py dispatches CPU
tensors to (fp32, or the bf16 outputs of bf16 linears), against the torch reference ops (kernels/reference.py) at
decode and prefill row counts."""
import pytest
import torch

from lmc.runtime import kernels
from lmc.runtime.attention.cpu_kernel import elementwise
from lmc.runtime.kernels import reference

TOL = dict(rtol=4e-6, atol=4e-6)  # a few ulp: the C++ sums and exp round differently from ATen's


@pytest.fixture(scope="module")
def ops():
    lib = elementwise()
    if lib is None:
        pytest.skip("no C++ toolchain here: the kernels could not be built (the reference ops are what runs)")
    return lib


def rand(*shape, seed, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("tokens", [1, 16, 200])
def test_norms_and_silu_mul_match_the_reference(ops, tokens):
    res, x, w = rand(tokens, 576, seed=1), rand(tokens, 576, seed=2), rand(576, seed=3)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5), **TOL)
    h, y = ops.add_rms_norm(res, x, w, 1e-5)
    ref_h, ref_y = reference.add_rms_norm(res, x, w, 1e-5)
    assert torch.equal(h, ref_h)
    torch.testing.assert_close(y, ref_y, **TOL)
    gu = rand(tokens, 2 * 1536, seed=4, scale=6)
    gu[0, :4] = torch.tensor([-200.0, 200.0, 90.0, -90.0])  # past exp's range: finite, 0 or the input
    out = ops.silu_mul(gu)
    torch.testing.assert_close(out, reference.silu_mul(gu), **TOL)
    assert out[0, :4].tolist()[0] == 0 and torch.isfinite(out).all()


@pytest.mark.parametrize("tokens", [1, 16, 200])
def test_rope_q_write_kv_matches_rope_then_index_writes(ops, tokens):
    hq, hkv, dim, num_slots = 9, 3, 64, tokens + 9
    qkv = rand(tokens, (hq + 2 * hkv) * dim, seed=5)
    angles = torch.randint(0, 4096, (tokens, 1)).float() * rand(1, dim // 2, seed=6).abs()
    cos, sin = torch.cat([angles.cos()] * 2, 1), torch.cat([angles.sin()] * 2, 1)
    slots = torch.randperm(num_slots, generator=torch.Generator().manual_seed(7))[:tokens]
    k_cache, v_cache = (torch.full((num_slots, hkv, dim), float("nan")) for _ in range(2))
    q = kernels.rope_q_write_kv(qkv, cos, sin, hq, hkv, dim, k_cache, v_cache, slots)
    ref_q, ref_k, ref_v = reference.rope_qk(qkv, cos, sin, hq, hkv, dim)
    torch.testing.assert_close(q, ref_q, **TOL)
    torch.testing.assert_close(k_cache[slots], ref_k, **TOL)
    assert torch.equal(v_cache[slots], ref_v)
    untouched = torch.ones(num_slots, dtype=torch.bool)
    untouched[slots] = False
    assert k_cache[untouched].isnan().all() and v_cache[untouched].isnan().all()


def test_bad_input_is_refused_by_name(ops):
    with pytest.raises(RuntimeError, match="slot out of range"):
        ops.rope_q_write_kv(torch.zeros(1, 5 * 4), torch.zeros(1, 4), torch.zeros(1, 4), 3, 1, torch.zeros(2, 1, 4),
                            torch.zeros(2, 1, 4), torch.tensor([2]))
    with pytest.raises(RuntimeError, match="fp32"):
        ops.rms_norm(torch.zeros(2, 4, dtype=torch.float64), torch.zeros(4), 1e-5)


def test_dispatch_takes_the_kernels_for_fp32_or_bf16_activations_between_fp32_operands(ops):
    x = torch.zeros(2, 8)
    assert kernels._cpu_ops(x) is ops and kernels.fuses_kv_write(x)
    # a bf16 linear's output between fp32 weights (Engine(dtype="bfloat16") on a CPU with native bf16)
    assert kernels._cpu_ops(x.bfloat16(), x) is ops and kernels.fuses_kv_write(x.bfloat16())
    # a model wholly in bf16 keeps the reference's roundings; other dtypes have no kernel
    assert kernels._cpu_ops(x.bfloat16(), x.bfloat16()) is None
    assert kernels._cpu_ops(x.double()) is None and not kernels.fuses_kv_write(x.half())


def test_rope_q_write_kv_into_a_bf16_cache_takes_the_reference(ops):
    """A model wholly in bf16 (a CPU without native bf16): RoPE in bf16 as the reference rounds it, then the writes."""
    qkv, cos, sin = rand(3, 5 * 4, seed=1).bfloat16(), *(rand(3, 4, seed=s).bfloat16() for s in (2, 3))
    caches, slots = [[torch.zeros(6, 1, 4, dtype=torch.bfloat16) for _ in range(2)] for _ in range(2)], torch.arange(3)
    q = kernels.rope_q_write_kv(qkv, cos, sin, 3, 1, 4, *caches[0], slots)
    assert torch.equal(q, reference.rope_q_write_kv(qkv, cos, sin, 3, 1, 4, *caches[1], slots))
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


@pytest.mark.parametrize("tokens", [1, 16, 200])
def test_bf16_activations_give_the_fp32_kernels_results_rounded_where_a_linear_rounds(ops, tokens):
    """A bf16 activation (a bf16 linear's output) widens exactly: each kernel gives what it gives for the widened
    fp32 input, with the outputs that feed a linear (the norm, SiLU-mul's product) rounded to bf16, ties to even,
    as that linear would round them; the residual stream, q and the KV cache stay fp32."""
    res, x, w = rand(tokens, 576, seed=1), rand(tokens, 576, seed=2).bfloat16(), rand(576, seed=3)
    h, y = kernels.add_rms_norm(res, x, w, 1e-5)
    h32, y32 = ops.add_rms_norm(res, x.float(), w, 1e-5)
    assert h.dtype == torch.float32 and y.dtype == torch.bfloat16
    assert torch.equal(h, h32) and torch.equal(y, y32.bfloat16())
    gu = rand(tokens, 2 * 1536, seed=4, scale=6).bfloat16()
    out = kernels.silu_mul(gu)
    assert out.dtype == torch.bfloat16 and torch.equal(out, ops.silu_mul(gu.float()).bfloat16())
    # the reference rounds twice (silu, then the product) where the kernel rounds once: at most a bf16 step apart
    assert (out.float() - reference.silu_mul(gu).float()).abs().le(out.float().abs() * 2 ** -7 + 1e-30).all()
    hq, hkv, dim, num_slots = 9, 3, 64, tokens + 9
    qkv = rand(tokens, (hq + 2 * hkv) * dim, seed=5).bfloat16()
    angles = torch.arange(tokens, dtype=torch.float32)[:, None] * rand(1, dim // 2, seed=6).abs()
    cos, sin = torch.cat([angles.cos()] * 2, 1), torch.cat([angles.sin()] * 2, 1)
    slots = torch.randperm(num_slots, generator=torch.Generator().manual_seed(7))[:tokens]
    caches = [[torch.zeros(num_slots, hkv, dim) for _ in range(2)] for _ in range(2)]
    q = kernels.rope_q_write_kv(qkv, cos, sin, hq, hkv, dim, *caches[0], slots)
    q32 = ops.rope_q_write_kv(qkv.float(), cos, sin, hq, hkv, *caches[1], slots)
    assert q.dtype == torch.float32 and torch.equal(q, q32)
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])
    assert torch.equal(caches[0][1][slots], qkv[:, (hq + hkv) * dim:].float().view(tokens, hkv, dim))


def test_bf16_rounding_keeps_nan_and_infinity(ops):
    """The kernels' rounding to bf16 (attention/cpu_kernel.py bf16_bits) at its edges, against torch's: a NaN stays
    a NaN (whatever its payload), an infinity stays infinite, the largest finite values round up to infinity."""
    g = torch.tensor([[float("nan"), float("inf"), float("-inf"), 3.4e38, -3.4e38, 1e-40, 0.0, 1.0]])
    gu = torch.cat([torch.full_like(g, 1e4), g], 1).bfloat16()
    out = ops.silu_mul(gu)  # silu(gate) = gate at 1e4 (9984 in bf16): out = 9984 * g, rounded to bf16
    ref = (gu[:, :8].float() * gu[:, 8:].float()).bfloat16()
    assert torch.equal(out.isnan(), ref.isnan()) and torch.equal(out[~out.isnan()], ref[~ref.isnan()])


def test_argmax_rows_is_torch_max_index(ops):
    x = rand(6, 49152, seed=8)
    x[1, 7] = x[1, 4000] = x[1].max() + 1  # a tie: the first index
    x[2] = float("-inf")  # all masked: index 0, as torch.max
    x[3, 99] = float("nan")  # a NaN wins, as in torch.max
    x[4, -1] = x[4].max() + 1  # the last column
    assert torch.equal(ops.argmax_rows(x), x.max(-1).indices)
    assert ops.argmax_rows(x[:, :37].contiguous()).tolist() == x[:, :37].max(-1).indices.tolist()


def test_kernels_run_their_parallel_loops_on_torchs_threads(ops):
    """The library is built with OpenMP: its at::parallel_for loops (the panel GEMM's panels, attention's work items,
    long inputs' rows) are `omp parallel` regions on torch's intra-op threads. With -fopenmp-simd alone they compiled
    to serial loops, and a decode step ran on one of the machine's cores."""
    import os

    from lmc.runtime.attention.cpu_kernel import library_dir

    with open(os.path.join(library_dir(), "lmc_cpu_kernels.so"), "rb") as f:
        assert b"GOMP_parallel" in f.read()


def test_threads_split_work_without_changing_a_bit(ops):
    """Each thread computes whole outputs (a GEMM panel, an attention work item) as one thread would: the results
    at 1 and 2 threads are identical, so outputs at temperature 0 do not depend on the thread count."""
    from lmc.runtime.attention.cpu_kernel import load, panels

    S, hq, hkv, d, b, pre = 4096, 9, 3, 64, 6, 120
    k, v, q = rand(S, hkv, d, seed=1), rand(S, hkv, d, seed=2), rand(b, hq, d, seed=3)
    table = torch.zeros(b + 1, 256, dtype=torch.int32)
    table[1:, :pre + 1] = torch.randperm(S, generator=torch.Generator().manual_seed(4))[:b * (pre + 1)].view(
        b, pre + 1).int()
    args = (torch.arange(1, b + 1), torch.full((b,), pre), torch.ones(b, dtype=torch.long), torch.arange(b), d ** -0.5)
    lib, before = panels(), torch.get_num_threads()
    x, w = rand(64, 576, seed=5), rand(1536, 576, seed=6)
    try:
        outs = []
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append((load()(q, k, v, table, *args),
                         *([lib.panel_linear(x, lib.pack_panels(w), 1536, None),
                            lib.panel_linear(x, lib.pack_panels(w.bfloat16()), 1536, None)] if lib is not None else [])))
    finally:
        torch.set_num_threads(before)
    for a, b in zip(*outs):  # attention, then the fp32 and bf16 panels' GEMM
        assert torch.equal(a, b)


@pytest.mark.parametrize("m", [1, 5, 8, 70])
def test_bf16_panels_sum_the_rounded_operands_products_in_fp32(m):
    """bf16 panels (model/linear.py): W as packed from bf16, x rounded to bf16 to the nearest, ties to even, as torch
    rounds it; the products exact in fp32 and summed in fp32; y rounded to bf16, then the bias added in fp32."""
    from lmc.runtime.attention.cpu_kernel import panels

    lib = panels()
    if lib is None:
        pytest.skip("no panel GEMM here (neither AVX-512 nor AVX2, or no C++ toolchain)")
    n, k = 170, 200  # a partial last panel; k-blocks with a partial last one
    x, w, bias = rand(m, k, seed=1), rand(n, k, seed=2), rand(n, seed=3)
    packed = lib.pack_panels(w.bfloat16())
    y = lib.panel_linear(x, packed, n, None)
    exact = torch.nn.functional.linear(x.bfloat16().double(), w.bfloat16().double())
    # the fp32 sum may sit on the other side of a bf16 rounding boundary than the exact one: one bf16 step apart
    assert (y.double() - exact).abs().le(exact.abs() * 2 ** -8 + 1e-6).all()
    assert torch.equal(y, y.bfloat16().float())  # y is a bf16 value
    assert torch.equal(lib.panel_linear(x, packed, n, bias), y + bias)  # the bias after the rounding, in fp32
    # the rounding of x itself, through an identity weight (finite x: an infinity times a 0 weight is nan): ties to
    # even, past the tie, negative, the carry into the exponent, large, subnormal, zero
    edge = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, 1 + 2 ** -8 + 2 ** -20, -(1 + 2 ** -8), 2 - 2 ** -9, 3.0e38,
                         1e-40, 0.0])
    xs = torch.cat([edge, rand(k - len(edge), seed=4)])[None]
    ident = lib.pack_panels(torch.eye(k).bfloat16())
    assert torch.equal(lib.panel_linear(xs, ident, k, None), xs.bfloat16().float())
    assert torch.isnan(lib.panel_linear(torch.full((1, k), float("nan")), ident, k, None)).all()
    # a bf16 x (a bf16 linear's output) is its fp32 value
    assert torch.equal(lib.panel_linear(x.bfloat16(), packed, n, bias), lib.panel_linear(x.bfloat16().float(), packed,
                                                                                         n, bias))


def test_the_library_builds_where_a_toolchain_is():
    """Where a C++ compiler is on PATH, the library builds, and on an AVX2 or AVX-512 CPU it has the panel GEMM: a
    silent fallback to the torch ops (as on AVX2 CPUs before, whose load probed the AVX-512-only op and raised) makes
    every other test here skip."""
    import shutil
    from lmc.runtime.attention.cpu_kernel import panels

    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler on PATH")
    assert elementwise() is not None
    try:
        flags = set(open("/proc/cpuinfo").read().split())
    except OSError:
        pytest.skip("no /proc/cpuinfo to read the CPU's features from")
    if {"avx512f"} <= flags or {"avx2", "fma"} <= flags:
        assert panels() is not None
