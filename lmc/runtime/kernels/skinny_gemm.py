"""A Triton GEMM for decode-sized linears: y = x W^T with x [M, K] for small M (a decode batch) and W [N, K] the
weight as stored (nn.Linear's layout, no transposed copy).

Why: a decode step reads every weight once, so each linear should run at the copy bandwidth. cuBLAS's choice for
M = 1 on the H200 leaves some shapes far from it (llama-2-7b's fused QKV, N = 12,288: 96 tiles of 128 columns for
132 SMs, ~1.8 TB/s against 4.25), and its split-K variants add a reduction launch. Here one program computes a
[BLOCK_M, BLOCK_N] tile over all of K, with BLOCK_N small enough that every shape spreads over more programs
than SMs, and Triton's software pipeline keeps `num_stages` weight tiles in flight per program.

Invariants: x and W have unit stride in K; y is a fresh contiguous [M, N] in x's dtype; accumulation in fp32 (the
rounding differs from cuBLAS's by the summation order only). M is at most MAX_M; larger batches are not skinny
and stay on cuBLAS (kernels.linear decides, from CONFIGS: only the shapes where this kernel measured faster).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_M = 64


@triton.jit
def _skinny_gemm_kernel(X, W, Y, M, N, K, stride_xm, stride_wn, stride_ym,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                        IEEE: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_ptrs = X + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = W + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)
        else:
            k_mask = (k + offs_k) < K
            x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if IEEE:  # fp32 operands: full precision, as F.linear in fp32 (Triton's default would be tf32)
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    y_ptrs = Y + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def _block_m(m: int) -> int:
    return max(16, triton.next_power_of_2(m))  # tl.dot needs 16 rows at least


# (BLOCK_M, N, K) -> (BLOCK_N, BLOCK_K, num_warps, num_stages): the shapes where this kernel beat cuBLAS by more than
# 2% in benchmarks/gpu_gemm_sweep.py on the H200 (2026-12-01, results/h200_probe/gemm_sweep.json; per-call time in a
# replayed graph over weights 8x the L2). Elsewhere cuBLAS runs (kernels.linear).
CONFIGS: dict[tuple[int, int, int], tuple[int, int, int, int]] = {
    (16, 12288, 4096): (64, 256, 4, 3),  # llama-2-7b qkv: 27.2 us against 28.1
    (16, 22016, 4096): (64, 128, 4, 3),  # llama-2-7b gate_up: 45.3 / 48.7
    (32, 22016, 4096): (64, 128, 4, 3),  # 47.7 / 50.0
    (16, 4096, 11008): (32, 512, 4, 5),  # llama-2-7b down: 26.3 / 27.8
    (16, 32000, 4096): (64, 128, 4, 3),  # llama-2-7b lm_head: 64.7 / 69.2
    (32, 32000, 4096): (64, 128, 4, 3),  # 67.9 / 70.4
    (64, 32000, 4096): (64, 128, 4, 3),  # 68.8 / 73.0
    (16, 6144, 4096): (64, 512, 4, 3),  # llama-3-8b qkv: 15.9 / 16.6
    (16, 28672, 4096): (32, 128, 4, 3),  # llama-3-8b gate_up: 59.1 / 61.3
    (32, 28672, 4096): (64, 128, 4, 3),  # 61.7 / 63.0
    (16, 128256, 4096): (64, 128, 4, 5),  # llama-3-8b lm_head: 239 / 249
    (32, 128256, 4096): (64, 128, 4, 3),  # 251 / 264
    (64, 128256, 4096): (64, 128, 4, 3),  # 264 / 285
}
def config_for(m: int, n: int, k: int) -> tuple[int, int, int, int] | None:
    """The measured tile for an [m, k] x [k, n] product, or None where cuBLAS is the faster choice (or m > MAX_M)."""
    if m > MAX_M or m < 1:
        return None
    return CONFIGS.get((_block_m(m), n, k))


@torch.compiler.disable  # a launch wrapper, run eagerly between compiled pieces (as triton_ops')
def skinny_gemm(x: torch.Tensor, w: torch.Tensor, config: tuple[int, int, int, int]) -> torch.Tensor:
    """x [..., K] @ w[N, K]^T -> [..., N], for prod(x.shape[:-1]) <= MAX_M.
    config: (BLOCK_N, BLOCK_K, num_warps, num_stages)."""
    k = w.shape[1]
    x2 = x.reshape(-1, x.shape[-1])
    m, n = x2.shape[0], w.shape[0]
    if x2.shape[1] != k or x2.stride(-1) != 1 or w.stride(-1) != 1:
        raise ValueError(f"skinny_gemm needs x [M, {k}] and w [N, K] with unit stride in K, "
                         f"got {tuple(x.shape)} and {tuple(w.shape)}")
    if m > MAX_M:
        raise ValueError(f"skinny_gemm serves at most {MAX_M} rows, got {m}")
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        block_n, block_k, warps, stages = config
        block_m = _block_m(m)
        grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
        _skinny_gemm_kernel[grid](x2, w, y, m, n, k, x2.stride(0), w.stride(0), y.stride(0), BLOCK_M=block_m,
                                  BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0,
                                  IEEE=x.dtype == torch.float32, num_warps=warps, num_stages=stages)
    return y.view(*x.shape[:-1], n)
