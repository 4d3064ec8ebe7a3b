"""A Triton GEMM for decode-sized linears: y = x W^T with x [M, K] for small M (a decode batch) and W [N, K] the
weight as stored (nn.Linear's layout, no transposed copy).

Why: a decode step reads every weight once, so each linear should run at the copy bandwidth. cuBLAS's choice for
M = 1 on the H200 leaves some shapes far from it (llama-2-7b's fused QKV, N = 12,288: 96 tiles of 128 columns for
132 SMs, ~1.8 TB/s against 4.25), and its split-K variants add a reduction launch. Here one program computes a
[BLOCK_M, BLOCK_N] tile over all of K, with BLOCK_N small enough that every shape spreads over more programs
than SMs, and Triton's software pipeline keeps `num_stages` weight tiles in flight per program.

Invariants: x and W have unit stride in K; y is a fresh contiguous [M, N] in x's dtype; accumulation in fp32 (the
rounding differs from cuBLAS's by the summation order only). M is at most MAX_M; larger batches are not skinny
and stay on cuBLAS (kernels.linear decides).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_M = 64


@triton.jit
def _skinny_gemm_kernel(X, W, Y, M, N, K, stride_xm, stride_wn, stride_ym,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
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
        acc = tl.dot(x, tl.trans(w), acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    y_ptrs = Y + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def _block_m(m: int) -> int:
    return max(16, triton.next_power_of_2(m))  # tl.dot needs 16 rows at least


def default_config(m: int, n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for an [m, k] x [k, n] product; see CONFIGS."""
    return CONFIGS.get((_block_m(m), n, k)) or CONFIGS.get((0, n, k)) or _fallback(m, n, k)


def _fallback(m: int, n: int, k: int) -> tuple[int, int, int, int]:
    """At least two programs per SM of an H200 (132) where N allows it, 64-byte-deep K tiles."""
    block_n = 64
    while block_n > 16 and triton.cdiv(n, block_n) < 264:
        block_n //= 2
    return block_n, 256, 4, 4


# Measured per shape class (BLOCK_M, N, K); 0 = any M. Filled from benchmarks/gpu_gemm_sweep.py on the H200.
CONFIGS: dict[tuple[int, int, int], tuple[int, int, int, int]] = {}


def skinny_gemm(x: torch.Tensor, w: torch.Tensor, config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x [..., K] @ w[N, K]^T -> [..., N], for prod(x.shape[:-1]) <= MAX_M."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    m, n = x2.shape[0], w.shape[0]
    if w.shape[1] != k or x2.stride(-1) != 1 or w.stride(-1) != 1:
        raise ValueError(f"skinny_gemm needs x [M, {w.shape[1]}] and w [N, K] with unit stride in K")
    if m > MAX_M:
        raise ValueError(f"skinny_gemm serves at most {MAX_M} rows, got {m}")
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        block_n, block_k, warps, stages = config or default_config(m, n, k)
        block_m = _block_m(m)
        grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
        _skinny_gemm_kernel[grid](x2, w, y, m, n, k, x2.stride(0), w.stride(0), y.stride(0), BLOCK_M=block_m,
                                  BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0, num_warps=warps,
                                  num_stages=stages)
    return y.view(*x.shape[:-1], n)
