"""A Triton GEMM for decode-sized linears: y = x W^T with x [M, K] for small M (a decode batch) and W [N, K] the
weight as stored (nn.Linear's layout, no transposed copy).

Why: a decode step reads every weight once, so each linear should run at the copy bandwidth. cuBLAS's choice for
M = 1 on the H200 leaves some shapes far from it (llama-2-7b's fused QKV, N = 12,288: 96 tiles of 128 columns for
132 SMs, ~1.8 TB/s against 4.25), and its split-K variants add a reduction launch. Here one program computes a
[BLOCK_M, BLOCK_N] tile over all of K, with BLOCK_N small enough that every shape spreads over more programs
than SMs, and Triton's software pipeline keeps `num_stages` weight tiles in flight per program. Where N is too
narrow for that (N = 4096: o_proj, down), SPLIT_K programs share a tile's K range and the last of them to finish
sums their fp32 partials: one launch, where cuBLAS's split-K adds a reduction kernel.

Gated (the MLP's gate_up_proj, `gated=True`): W is [2I, K], gate rows then up rows, and the result is
silu(x gate^T) * (x up^T) [M, I], the SiLU-mul in the epilogue instead of a kernel of its own. A program's BLOCK_N
weight rows are BLOCK_N / 2 gate rows and the up rows of the same outputs, loaded as ONE tile (its row index maps
the second half into the up block): the plain product's loads and tl.dot, then a split of the accumulator. Measured
per shape (GATED_CONFIGS): llama-3-8b's gate_up gains 1.3-2.8% of a decode step at batch 1-32; llama-2-7b's runs
slower gated than as two launches at every batch size, so it keeps them (h200_probe/gemm_sweep_gated.json; an
earlier try with gate and up as two half-width tiles and two dots was slower still, h200_probe/step_ab3).

RoPE (`skinny_gemm_rope`, the QKV projection of a decode step): the tile's two halves are the same rows of a head's
two halves, which rotate-half RoPE mixes, so the epilogue rotates q and k and writes q, and k and v straight into
the KV cache at the tokens' slots: triton_ops.rope_q_write_kv's launch saved, with its roundings (ROPE_MAX_M: where
it measured faster).

Invariants: x and W have unit stride in K; y is a fresh contiguous [M, N] in x's dtype; accumulation in fp32 (the
rounding differs from cuBLAS's by the summation order only). M is at most MAX_M; larger batches are not skinny
and stay on cuBLAS (kernels.linear decides, from CONFIGS: only the shapes where this kernel measured faster).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import grid_dependency, pdl_args
from .triton_ops import _rotate, _round, _silu_times

MAX_M = 64


@triton.jit
def _skinny_gemm_kernel(X, W, Y, P, C, M, N, K, K_SPLIT, stride_xm, stride_wn, stride_ym,
                        COS, SIN, stride_cs, KC, VC, SLOTS, HQ, HKV,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                        IEEE: tl.constexpr, SPLIT_K: tl.constexpr, PDL: tl.constexpr, GATED: tl.constexpr = False,
                        BF16: tl.constexpr = False, ROPE: tl.constexpr = 0):
    """Program (n, m, s): the [BLOCK_M, BLOCK_N] tile over K's range [s K_SPLIT, (s + 1) K_SPLIT). With SPLIT_K > 1
    each split stores its fp32 partial in P [SPLIT_K, M, N] and counts itself in C (one int32 per tile); the
    split that counts last sums the partials in split order (so the result is the same whichever is last), writes
    Y and sets the counter back to 0 for the next launch (C is zero between launches: no memset, graph-safe).
    GATED (SPLIT_K 1): N is the output width I, W has 2I rows; the tile's rows j < BLOCK_N / 2 are gate row
    pid_n BLOCK_N / 2 + j, the others the up rows of the same outputs, and Y gets silu(gate) * up, rounded where
    the unfused product and silu_mul round (BF16: to bf16 in integer arithmetic, as triton_ops._round).
    ROPE = D > 0 (SPLIT_K 1): W is the fused QKV weight, HQ q heads then HKV k and HKV v heads of D rows; the tile's
    rows j < BLOCK_N / 2 are one head's rows c0 + j of its first half, the others the same rows of its second half
    (the pairs rotate-half RoPE mixes); the epilogue rounds the product as the unfused GEMM stores it, rotates q and
    k rows by COS / SIN ([M, D] rows at stride_cs, the tokens' positions) as triton_ops.rope_q_write_kv does, and
    stores q into Y ([M, HQ D]) and k, v into the layer's caches KC, VC ([slots, HKV, D]) at SLOTS[m]."""
    grid_dependency(PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    if GATED:
        HALF: tl.constexpr = BLOCK_N // 2
        j = tl.arange(0, BLOCK_N)
        out_col = pid_n * HALF + j % HALF  # the output column the row serves
        n_mask = out_col < N
        offs_n = out_col + (j >= HALF).to(tl.int32) * N  # gate rows, then the up rows I further down
    elif ROPE:
        HALF: tl.constexpr = BLOCK_N // 2
        PER_HEAD: tl.constexpr = ROPE // 2 // HALF  # programs per head
        head = pid_n // PER_HEAD
        c0 = (pid_n % PER_HEAD) * HALF  # the first of the tile's rows within each half of the head
        j = tl.arange(0, BLOCK_N)
        offs_n = head * ROPE + c0 + j % HALF + (j >= HALF).to(tl.int32) * (ROPE // 2)
        n_mask = offs_n < N
    else:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
    k_lo = pid_s * K_SPLIT
    k_hi = tl.minimum(k_lo + K_SPLIT, K)
    x_ptrs = X + offs_m.to(tl.int64)[:, None] * stride_xm + (k_lo + offs_k)[None, :]
    w_ptrs = W + offs_n.to(tl.int64)[:, None] * stride_wn + (k_lo + offs_k)[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)
        else:
            k_mask = (k + offs_k) < k_hi
            x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if IEEE:  # fp32 operands: full precision, as F.linear in fp32 (Triton's default would be tf32)
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if GATED:
        ty = Y.dtype.element_ty
        # [BLOCK_M, BLOCK_N] -> [BLOCK_M, HALF, 2] (gate, up) pairs, split into the two halves
        gate, up = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, HALF)), (0, 2, 1)))
        # the product rounds to `ty` first, as the unfused GEMM's output does
        h = _silu_times(_round(gate, ty, BF16).to(tl.float32), _round(up, ty, BF16).to(tl.float32), ty, BF16)
        cols = pid_n * HALF + tl.arange(0, HALF)
        tl.store(Y + offs_m.to(tl.int64)[:, None] * stride_ym + cols[None, :], h,
                 mask=m_mask[:, None] & (cols < N)[None, :])
    elif ROPE:
        ty = Y.dtype.element_ty
        lo, hi = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, HALF)), (0, 2, 1)))
        lo = _round(lo, ty, BF16)  # the product as the unfused GEMM stores it
        hi = _round(hi, ty, BF16)
        d = c0 + tl.arange(0, HALF)[None, :]
        m64 = offs_m.to(tl.int64)[:, None]
        mask = m_mask[:, None]
        if head < HQ + HKV:  # q and k rotate, v does not
            cs = m64 * stride_cs + d
            lo, hi = _rotate(lo.to(tl.float32), hi.to(tl.float32),
                             tl.load(COS + cs, mask=mask, other=0.0).to(tl.float32),
                             tl.load(COS + cs + ROPE // 2, mask=mask, other=0.0).to(tl.float32),
                             tl.load(SIN + cs, mask=mask, other=0.0).to(tl.float32),
                             tl.load(SIN + cs + ROPE // 2, mask=mask, other=0.0).to(tl.float32), ty, BF16)
        if head < HQ:
            dst = Y + m64 * stride_ym + head * ROPE + d
        else:
            kv_head = (head - HQ) % HKV
            if head < HQ + HKV:
                cache = KC
            else:
                cache = VC
            dst = cache + (tl.load(SLOTS + offs_m, mask=m_mask, other=0).to(tl.int64)[:, None] * HKV
                           + kv_head) * ROPE + d
        tl.store(dst, lo, mask=mask)
        tl.store(dst + ROPE // 2, hi, mask=mask)
    elif SPLIT_K == 1:
        tl.store(Y + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty),
                 mask=m_mask[:, None] & n_mask[None, :])
    else:
        mn_mask = m_mask[:, None] & n_mask[None, :]
        y_ptrs = Y + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
        mn = offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
        tl.store(P + pid_s * M * N + mn, acc, mask=mn_mask)
        tile = C + pid_m * tl.num_programs(0) + pid_n
        # acq_rel: this split's partial is visible before its count, and the last split sees every partial.
        if tl.atomic_add(tile, 1, sem="acq_rel") == SPLIT_K - 1:
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):
                total += tl.load(P + s * M * N + mn, mask=mn_mask, other=0.0, cache_modifier=".cg")
            tl.store(y_ptrs, total.to(Y.dtype.element_ty), mask=mn_mask)
            tl.atomic_xchg(tile, 0)


def _block_m(m: int) -> int:
    return max(16, triton.next_power_of_2(m))  # tl.dot needs 16 rows at least


# (BLOCK_M, N, K) -> (BLOCK_N, BLOCK_K, num_warps, num_stages): the shapes where this kernel beat cuBLAS by more than
# 2% in benchmarks/gpu_gemm_sweep.py on the H200 (2026-12-01, results/h200_probe/gemm_sweep.json; per-call time in a
# replayed graph over weights 8x the L2; cuBLAS's time includes its split-K reduction kernel). Elsewhere cuBLAS runs
# (kernels.linear). The split-K rows (a 5th entry) are from `gpu_gemm_sweep.py --split`
# (results/h200_probe/gemm_sweep_split.json): N = 4096 has too few column tiles to fill the SMs unsplit.
CONFIGS: dict[tuple[int, int, int], tuple[int, ...]] = {
    (16, 12288, 4096): (32, 128, 4, 4),  # llama-2-7b qkv: 26.5 us against 28.7 (the earlier 64x256 tile: 26.9)
    (16, 4096, 4096): (32, 128, 4, 4, 2),  # llama-2-7b and llama-3-8b o_proj: 12.3 / 13.1 (floor 7.8)
    (16, 22016, 4096): (64, 128, 4, 3),  # llama-2-7b gate_up: 45.3 / 48.7
    (32, 22016, 4096): (64, 128, 4, 3),  # 47.7 / 50.0
    (16, 4096, 11008): (128, 128, 4, 4, 4),  # llama-2-7b down: 25.5 / 28.0 (the earlier unsplit 32x512: 26.3)
    (16, 32000, 4096): (64, 128, 4, 3),  # llama-2-7b lm_head: 64.7 / 69.2
    (32, 32000, 4096): (64, 128, 4, 3),  # 67.9 / 70.4
    (64, 32000, 4096): (64, 128, 4, 3),  # 68.8 / 73.0
    (16, 6144, 4096): (64, 512, 4, 3),  # llama-3-8b qkv: 15.9 / 16.6
    (16, 28672, 4096): (32, 128, 4, 3),  # llama-3-8b gate_up: 59.1 / 61.3
    (32, 28672, 4096): (64, 128, 4, 3),  # 61.7 / 63.0
    (16, 128256, 4096): (64, 128, 4, 5),  # llama-3-8b lm_head: 239 / 249
    (32, 128256, 4096): (64, 128, 4, 3),  # 251 / 264
    (64, 128256, 4096): (64, 128, 4, 3),  # 264 / 285
    # SmolLM2-135M (the embedded model), measured on a lent H100 at M = 1 and 4 (2026-12-06,
    # results/h100_probe/sweep_smollm2.log): every linear of its layers is launch-bound (0.3-3.5 MB of weights), and
    # cuBLAS's kernels for them take ~1 us more a call. qkv keeps a 32-row tile, which carries the RoPE epilogue.
    (16, 960, 576): (32, 128, 4, 5),  # qkv: 3.0 us against 3.3 (the 16-row tile: 2.7)
    (16, 576, 576): (16, 128, 4, 5),  # o_proj: 2.6 / 3.6
    (16, 3072, 576): (32, 128, 4, 5),  # gate_up: 3.5 / 4.2
    (16, 576, 1536): (16, 128, 4, 5),  # down: 4.0 / 5.1
}


# (BLOCK_M, 2I, K) -> (BLOCK_N, BLOCK_K, num_warps, num_stages) of the gated product (the MLP's gate_up with the
# SiLU-mul in the epilogue): the shapes where it beat the product and silu_mul as two launches (the table's tile or
# cuBLAS, then silu_mul) in `benchmarks/gpu_gemm_sweep.py --gated` on the H200 (results/h200_probe/
# gemm_sweep_gated.json). Elsewhere kernels.linear_silu_mul runs the two.
GATED_CONFIGS: dict[tuple[int, int, int], tuple[int, ...]] = {
    (16, 28672, 4096): (64, 256, 4, 3),  # llama-3-8b gate_up: 57.6 us against 58.2 at M = 8, 58.2 / 59.1 at M = 16
    (32, 28672, 4096): (64, 256, 4, 3),  # 61.6 / 63.3
    (16, 3072, 576): (32, 128, 4, 5),  # SmolLM2-135M (H100, M = 1 and 4): 3.6 us against 5.3 (sweep_gated_smollm2.log)
}


def config_for(m: int, n: int, k: int, gated: bool = False) -> tuple[int, ...] | None:
    """The measured tile for an [m, k] x [k, n] product (gated: the gate_up product with its SiLU-mul, n = 2I), or
    None where cuBLAS (and silu_mul) is the faster choice (or m > MAX_M)."""
    if m > MAX_M or m < 1:
        return None
    return (GATED_CONFIGS if gated else CONFIGS).get((_block_m(m), n, k))


_counters: dict[torch.device, torch.Tensor] = {}


def _tile_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """The split-K tile counters of `device`: zeros, kept zero by the kernel itself. Allocated (or grown) on first
    use, which is a warm-up forward before any CUDA-graph capture (cuda_graph.DecodeGraphs), so a captured graph
    and every later launch share the same buffer."""
    c = _counters.get(device)
    if c is None or c.numel() < tiles:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("skinny_gemm's split-K counters must be allocated by a warm-up run before capture")
        c = _counters[device] = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device)
    return c


@torch.compiler.disable  # a launch wrapper, run eagerly between compiled pieces (as triton_ops')
def skinny_gemm(x: torch.Tensor, w: torch.Tensor, config: tuple[int, ...], gated: bool = False) -> torch.Tensor:
    """x [..., K] @ w[N, K]^T -> [..., N], for prod(x.shape[:-1]) <= MAX_M.
    config: (BLOCK_N, BLOCK_K, num_warps, num_stages[, SPLIT_K]); SPLIT_K (default 1) programs share each tile's
    K range, for shapes with too few output tiles to fill the SMs (N = 4096 has 64 tiles of 64 columns).
    gated: w is [2I, K] (gate rows, then up rows) and the result silu(x gate^T) * (x up^T) [..., I]; `config` as
    for the plain product, its BLOCK_N the weight rows a program reads (BLOCK_N / 2 outputs), and no split K."""
    x2, (m, n, k) = _operands(x, w)
    if gated:
        if n % 2 or config[4:] not in ((), (1,)) or config[0] < 32:
            raise ValueError(f"a gated skinny_gemm needs w [2I, K], BLOCK_N >= 32 and no split K, got "
                             f"{tuple(w.shape)} and {config}")
        n //= 2
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _launch(x2, w, y, config, n, GATED=gated)
    return y.view(*x.shape[:-1], n)


# (N, K) of a fused QKV weight -> the largest M whose decode step ran faster with RoPE and the KV write in the
# GEMM's epilogue than with rope_q_write_kv as its own kernel (`benchmarks/gpu_step_ab.py --variants
# pdl,pdl_rope_apart --batches 1,8,16`, H200, results/h200_probe/step_ab9_rope_epilogue.json; graph replay ms, fused
# / apart): llama-2-7b 3.874 / 3.900 at batch 1, 4.232 / 4.389 at 8, but 4.822 / 4.701 at 16; llama-3-8b 4.335 /
# 4.390, 4.581 / 4.611, 4.778 / 4.828. Elsewhere the two kernels run.
# SmolLM2-135M's QKV (960, 576), up to its 16-row tile: the decode graph replayed with RoPE skipped took 0.888 against
# 0.933 ms at batch 1 and 4 (H100, results/h100_probe/fusion_bound_smollm2.json), ~1.5 us a layer for its launch.
ROPE_MAX_M: dict[tuple[int, int], int] = {(12288, 4096): 8, (6144, 4096): 16, (960, 576): 16}


def rope_config_for(m: int, n: int, k: int, head_dim: int) -> tuple[int, ...] | None:
    """The plain table's tile for the QKV product where skinny_gemm_rope measured faster and the tile fits the
    heads, else None."""
    cfg = config_for(m, n, k)
    if cfg is None or m > ROPE_MAX_M.get((n, k), 0) or not rope_tile_fits(cfg, head_dim):
        return None
    return cfg


def rope_tile_fits(config: tuple[int, ...], head_dim: int) -> bool:
    """Whether `config`'s tile can carry skinny_gemm_rope's epilogue for heads of `head_dim`: no split K, and each
    half of the tile's rows within one half of a head."""
    half = config[0] // 2
    return config[4:] in ((), (1,)) and half >= 16 and head_dim % 2 == 0 and (head_dim // 2) % half == 0


@torch.compiler.disable  # a launch wrapper, run eagerly between compiled pieces (as triton_ops')
def skinny_gemm_rope(x: torch.Tensor, w: torch.Tensor, config: tuple[int, ...], cos: torch.Tensor,
                     sin: torch.Tensor, num_q_heads: int, num_kv_heads: int, head_dim: int, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """triton_ops.rope_q_write_kv(x @ w^T, ...) in one kernel: w is the fused QKV weight [(Hq + 2 Hkv) D, K]; q
    [M, Hq, D] is returned and the rotated k and the v of each token written into one layer's caches
    ([num_slots, Hkv, D]) at its slot, with the unfused ops' roundings. `config`: a plain tile that
    rope_tile_fits."""
    x2, (m, n, k) = _operands(x, w)
    if n != (num_q_heads + 2 * num_kv_heads) * head_dim or not rope_tile_fits(config, head_dim):
        want = (num_q_heads + 2 * num_kv_heads) * head_dim
        raise ValueError(f"skinny_gemm_rope needs w [(Hq + 2 Hkv) D, K] = [{want}, K] and a tile that fits the "
                         f"heads, got {tuple(w.shape)} and {config}")
    if cos.shape != (m, head_dim) or sin.stride() != cos.stride() or cos.stride(1) != 1:
        raise ValueError("cos/sin must be [M, head_dim] with the same strides")
    if (k_cache.shape[1:] != (num_kv_heads, head_dim) or v_cache.shape != k_cache.shape
            or not (k_cache.is_contiguous() and v_cache.is_contiguous()) or k_cache.dtype != x.dtype
            or slots.shape != (m,)):
        raise ValueError("k/v caches must be contiguous [num_slots, Hkv, D] of x's dtype, and slots [M]")
    q = torch.empty(m, num_q_heads, head_dim, dtype=x.dtype, device=x.device)
    _launch(x2, w, q, config, n, rope=(cos, sin, k_cache, v_cache, slots, num_q_heads, num_kv_heads, head_dim))
    return q


def _operands(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
    k = w.shape[1]
    x2 = x.reshape(-1, x.shape[-1])
    m, n = x2.shape[0], w.shape[0]
    if x2.shape[1] != k or x2.stride(-1) != 1 or w.stride(-1) != 1:
        raise ValueError(f"skinny_gemm needs x [M, {k}] and w [N, K] with unit stride in K, "
                         f"got {tuple(x.shape)} and {tuple(w.shape)}")
    if m > MAX_M:
        raise ValueError(f"skinny_gemm serves at most {MAX_M} rows, got {m}")
    return x2, (m, n, k)


def _launch(x2: torch.Tensor, w: torch.Tensor, y: torch.Tensor, config: tuple[int, ...], n: int,
            GATED: bool = False, rope: tuple | None = None) -> None:
    """Launch the kernel for x2 [M, K] @ w^T into y ([M, n] outputs; n: the output width, I for a gated product)."""
    m, k = x2.shape
    if not m:
        return
    block_n, block_k, warps, stages, *rest = config
    split = rest[0] if rest else 1
    block_m = _block_m(m)
    k_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k  # each split a whole number of K blocks
    split = triton.cdiv(k, k_split)
    grid = (triton.cdiv(n, block_n // 2 if GATED else block_n), triton.cdiv(m, block_m), split)
    if split > 1:
        parts = torch.empty(split, m, n, dtype=torch.float32, device=x2.device)
        counters = _tile_counters(x2.device, grid[0] * grid[1])
    else:
        parts = counters = y  # unused
    cos, sin, kc, vc, slots, hq, hkv, hd = rope or (y, y, y, y, y, 0, 0, 0)  # (unused without RoPE)
    _skinny_gemm_kernel[grid](x2, w, y, parts, counters, m, n, k, k_split, x2.stride(0), w.stride(0),
                              y.stride(0), cos, sin, cos.stride(0), kc, vc, slots, hq, hkv, BLOCK_M=block_m,
                              BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
                              IEEE=x2.dtype == torch.float32, SPLIT_K=split, GATED=GATED,
                              BF16=x2.dtype == torch.bfloat16, ROPE=hd, num_warps=warps, num_stages=stages,
                              **pdl_args(x2))
