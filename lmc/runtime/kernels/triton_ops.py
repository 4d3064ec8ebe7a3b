"""Triton kernels for the fused ops of kernels/__init__.py. Each rounds to the activation dtype exactly where the
torch reference (reference.py) rounds, computing in fp32 in between, so bf16 results differ from it by an ulp at
most (reduction order, exp/rsqrt implementations), not by a re-association of bf16 arithmetic.

Invariants: inputs are row-major with unit stride in the last dim; outputs are fresh contiguous tensors (except
the residual stream `h`, also fresh). One program handles one token row (or one block of a row for SiLU-mul), so
the launch grid scales with the token count and a decode step is one small launch per op. Each kernel starts with
launch.grid_dependency: on Hopper they launch with programmatic dependent launch (launch.py).

The launch wrappers are excluded from torch.compile (dynamo cannot trace their grid arithmetic over symbolic
shapes): a compiled forward on the GPU calls them eagerly between its graphs, as it calls attention.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import grid_dependency, pdl_args


@triton.jit
def _round(x, ty: tl.constexpr, BF16: tl.constexpr):
    """fp32 x to the activation dtype `ty`. For bf16 the round to nearest even is done in integer arithmetic, after
    which the cast is exact: the GPU's cast rounds so too, but the interpreter's truncates, and the CPU tests must
    see the GPU's numbers."""
    if BF16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + (0x7FFF + ((bits >> 16) & 1))) >> 16) << 16
        y = bits.to(tl.float32, bitcast=True).to(ty)
    else:
        y = x.to(ty)
    return y


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, h_ptr, out_ptr, w_ptr, stride_x, stride_r, D, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, BF16: tl.constexpr, PDL: tl.constexpr):
    grid_dependency(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = _round(r.to(tl.float32) + x.to(tl.float32), h_ptr.dtype.element_ty, BF16)  # torch rounds here
        tl.store(h_ptr + row * D + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / D + eps)
    ty = out_ptr.dtype.element_ty
    normed = _round(xf * inv, ty, BF16)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * D + cols, _round(w.to(tl.float32) * normed.to(tl.float32), ty, BF16), mask=mask)


def _norm_launch(x, residual, weight, eps):
    if x.stride(-1) != 1 or (residual is not None and residual.stride(-1) != 1):
        raise ValueError("rms_norm needs unit stride in the last dim")
    d = x.shape[-1]
    x2 = x.reshape(-1, d)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    h = torch.empty_like(out) if residual is not None else out
    r2 = residual.reshape(-1, d) if residual is not None else x2
    if x2.shape[0]:
        block = triton.next_power_of_2(d)
        _rms_norm_kernel[(x2.shape[0],)](x2, r2, h, out, weight, x2.stride(0), r2.stride(0), d, eps,
                                         HAS_RESIDUAL=residual is not None, BLOCK=block,
                                         BF16=x.dtype == torch.bfloat16,
                                         num_warps=min(16, max(1, block // 256)), **pdl_args(x))
    return h.view(x.shape), out.view(x.shape)


@torch.compiler.disable  # launch wrappers run eagerly between compiled pieces (see module doc)
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _norm_launch(x, None, weight, eps)[1]


@torch.compiler.disable  # launch wrappers run eagerly between compiled pieces (see module doc)
def add_rms_norm(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if residual.shape != x.shape:
        raise ValueError(f"residual {tuple(residual.shape)} and x {tuple(x.shape)} differ in shape")
    return _norm_launch(x, residual, weight, eps)


@triton.jit
def _silu_times(g, u, ty: tl.constexpr, BF16: tl.constexpr):
    """silu(g) * u for fp32 g and u (already rounded to `ty` where torch's ops round), in `ty`, rounded as
    F.silu(g) * u rounds: after the SiLU and after the product (also the skinny GEMM's gated epilogue)."""
    s = _round(g / (1.0 + tl.exp(-g)), ty, BF16)  # F.silu rounds here
    return _round(s.to(tl.float32) * u, ty, BF16)


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, stride_gu, inter, BLOCK: tl.constexpr, BF16: tl.constexpr,
                     PDL: tl.constexpr):
    grid_dependency(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    g = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_gu + inter + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * inter + cols, _silu_times(g, u, out_ptr.dtype.element_ty, BF16), mask=mask)


@torch.compiler.disable  # launch wrappers run eagerly between compiled pieces (see module doc)
def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if gate_up.stride(-1) != 1 or gate_up.shape[-1] % 2:
        raise ValueError("silu_mul needs [..., 2I] with unit stride in the last dim")
    inter = gate_up.shape[-1] // 2
    gu = gate_up.reshape(-1, 2 * inter)
    out = torch.empty(gu.shape[0], inter, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    if gu.shape[0]:
        _silu_mul_kernel[(gu.shape[0], triton.cdiv(inter, block))](gu, out, gu.stride(0), inter, BLOCK=block,
                                                                    BF16=gate_up.dtype == torch.bfloat16,
                                                                    num_warps=4, **pdl_args(gate_up))
    return out.view(*gate_up.shape[:-1], inter)


@triton.jit
def _rope_heads(src_ptr, dst_ptr, c_lo, c_hi, s_lo, s_hi, heads, HALF: tl.constexpr, D: tl.constexpr,
                BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, BF16: tl.constexpr):
    """Rotate `heads` heads of one token, src (stride D between heads) -> dst (contiguous heads)."""
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < heads) & (d < HALF)
    x_lo = tl.load(src_ptr + h * D + d, mask=mask, other=0.0).to(tl.float32)
    x_hi = tl.load(src_ptr + h * D + HALF + d, mask=mask, other=0.0).to(tl.float32)
    lo, hi = _rotate(x_lo, x_hi, c_lo, c_hi, s_lo, s_hi, dst_ptr.dtype.element_ty, BF16)
    tl.store(dst_ptr + h * D + d, lo, mask=mask)
    tl.store(dst_ptr + h * D + HALF + d, hi, mask=mask)


@triton.jit
def _rotate(x_lo, x_hi, c_lo, c_hi, s_lo, s_hi, ty: tl.constexpr, BF16: tl.constexpr):
    """Rotate-half RoPE of a head's two halves (fp32 values of `ty`) -> the two rotated halves in `ty`; torch's
    x * cos + cat(-x_hi, x_lo) * sin, each product and the sum rounded to the activation dtype (also the skinny
    GEMM's RoPE epilogue)."""
    lo = _round(_round(x_lo * c_lo, ty, BF16).to(tl.float32) + _round(-x_hi * s_lo, ty, BF16).to(tl.float32),
                ty, BF16)
    hi = _round(_round(x_hi * c_hi, ty, BF16).to(tl.float32) + _round(x_lo * s_hi, ty, BF16).to(tl.float32),
                ty, BF16)
    return lo, hi


@triton.jit
def _rope_qk_kernel(qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, slots_ptr, stride_qkv, stride_cs, HQ, HKV,
                    HQ_S, HKV_S, D: tl.constexpr, HALF: tl.constexpr, BLOCK_HQ: tl.constexpr,
                    BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr, BF16: tl.constexpr,
                    WRITE_KV: tl.constexpr, PDL: tl.constexpr):
    """Token t = program 0's index, heads split s = program 1's (HQ_S q heads and HKV_S kv heads from s on): q
    rotated into q_ptr's row t; k rotated into k_ptr's row t, or with WRITE_KV into the KV cache's slot slots[t]
    (k_ptr, v_ptr: one layer's [num_slots, HKV, D] buffers), v copied there too."""
    grid_dependency(PDL)
    t = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    d = tl.arange(0, BLOCK_HALF)[None, :]
    dm = d < HALF
    cs = t * stride_cs
    c_lo = tl.load(cos_ptr + cs + d, mask=dm, other=0.0).to(tl.float32)
    c_hi = tl.load(cos_ptr + cs + HALF + d, mask=dm, other=0.0).to(tl.float32)
    s_lo = tl.load(sin_ptr + cs + d, mask=dm, other=0.0).to(tl.float32)
    s_hi = tl.load(sin_ptr + cs + HALF + d, mask=dm, other=0.0).to(tl.float32)
    row = qkv_ptr + t * stride_qkv
    q_off = s * HQ_S * D
    _rope_heads(row + q_off, q_ptr + t * HQ * D + q_off, c_lo, c_hi, s_lo, s_hi, HQ_S, HALF, D, BLOCK_HQ,
                BLOCK_HALF, BF16)
    kv_off = s * HKV_S * D
    if WRITE_KV:
        dst = tl.load(slots_ptr + t).to(tl.int64) * HKV * D + kv_off
        _rope_heads(row + HQ * D + kv_off, k_ptr + dst, c_lo, c_hi, s_lo, s_hi, HKV_S, HALF, D, BLOCK_HKV,
                    BLOCK_HALF, BF16)
        h = tl.arange(0, BLOCK_HKV)[:, None]
        e = tl.arange(0, BLOCK_D)[None, :]
        vm = (h < HKV_S) & (e < D)
        tl.store(v_ptr + dst + h * D + e, tl.load(row + (HQ + HKV) * D + kv_off + h * D + e, mask=vm), mask=vm)
    else:
        _rope_heads(row + HQ * D + kv_off, k_ptr + t * HKV * D + kv_off, c_lo, c_hi, s_lo, s_hi, HKV_S, HALF, D,
                    BLOCK_HKV, BLOCK_HALF, BF16)


# Up to this many tokens a launch splits each token's heads over programs (one kv head and its query group each):
# a decode step's few tokens then spread over many SMs instead of one program per token running alone (llama-2-7b
# at batch 1: 3.6 us a layer as one program). Longer extends keep one program per token, already plenty.
_ROPE_SPLIT_MAX_TOKENS = 256


def _check_rope(qkv, cos, sin, num_q_heads, num_kv_heads, head_dim):
    if head_dim % 2:
        raise ValueError(f"rotary embedding needs an even head_dim, got {head_dim}")
    width = (num_q_heads + 2 * num_kv_heads) * head_dim
    if qkv.dim() != 2 or qkv.shape[1] != width or qkv.stride(1) != 1:
        raise ValueError(f"qkv must be [T, {width}] with unit stride in the last dim, got {tuple(qkv.shape)}")
    if cos.shape != (qkv.shape[0], head_dim) or cos.stride() != sin.stride() or cos.stride(1) != 1:
        raise ValueError("cos/sin must be [T, head_dim] with the same strides")


def _rope_launch(qkv, cos, sin, q, k, v, slots, num_q_heads, num_kv_heads, head_dim, write_kv):
    t = qkv.shape[0]
    if t:
        half = head_dim // 2
        splits = num_kv_heads if t <= _ROPE_SPLIT_MAX_TOKENS and num_q_heads % num_kv_heads == 0 else 1
        hq, hkv = num_q_heads // splits, num_kv_heads // splits
        _rope_qk_kernel[(t, splits)](qkv, cos, sin, q, k, v, slots, qkv.stride(0), cos.stride(0), num_q_heads,
                                     num_kv_heads, hq, hkv, D=head_dim, HALF=half,
                                     BLOCK_HQ=triton.next_power_of_2(hq), BLOCK_HKV=triton.next_power_of_2(hkv),
                                     BLOCK_HALF=triton.next_power_of_2(half),
                                     BLOCK_D=triton.next_power_of_2(head_dim), BF16=qkv.dtype == torch.bfloat16,
                                     WRITE_KV=write_kv, num_warps=4 if splits == 1 else 1, **pdl_args(qkv))


@torch.compiler.disable  # launch wrappers run eagerly between compiled pieces (see module doc)
def rope_qk(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_q_heads: int, num_kv_heads: int,
            head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    _check_rope(qkv, cos, sin, num_q_heads, num_kv_heads, head_dim)
    t = qkv.shape[0]
    q = torch.empty(t, num_q_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(t, num_kv_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    _rope_launch(qkv, cos, sin, q, k, k, cos, num_q_heads, num_kv_heads, head_dim, False)  # v, slots unused
    v = qkv[:, (num_q_heads + num_kv_heads) * head_dim:].view(t, num_kv_heads, head_dim)
    return q, k, v


@torch.compiler.disable  # launch wrappers run eagerly between compiled pieces (see module doc)
def rope_q_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_q_heads: int, num_kv_heads: int,
                    head_dim: int, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    _check_rope(qkv, cos, sin, num_q_heads, num_kv_heads, head_dim)
    shape = (num_kv_heads, head_dim)
    if k_cache.shape[1:] != shape or v_cache.shape != k_cache.shape or not (k_cache.is_contiguous()
                                                                           and v_cache.is_contiguous()):
        raise ValueError(f"k/v caches must be contiguous [num_slots, {num_kv_heads}, {head_dim}]")
    if slots.shape != (qkv.shape[0],) or k_cache.dtype != qkv.dtype:
        raise ValueError("slots must be [T] and the caches of qkv's dtype")
    q = torch.empty(qkv.shape[0], num_q_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    _rope_launch(qkv, cos, sin, q, k_cache, v_cache, slots, num_q_heads, num_kv_heads, head_dim, True)
    return q


@triton.jit
def _decode_inputs_kernel(tok_ptr, table_ptr, rows_ptr, pos_ptr, slots_ptr, ids_ptr, seq_ptr, n, stride_table,
                          GATHER: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    grid_dependency(PDL)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    row = tl.load(rows_ptr + i, mask=m, other=0)
    pos = tl.load(pos_ptr + i, mask=m, other=0)
    if GATHER:
        tl.store(ids_ptr + i, tl.load(tok_ptr + row, mask=m, other=0), mask=m)
    tl.store(seq_ptr + i, (pos + 1).to(seq_ptr.dtype.element_ty), mask=m)
    slot = tl.load(slots_ptr + i, mask=m, other=0)
    tl.store(table_ptr + row * stride_table + pos, slot.to(table_ptr.dtype.element_ty), mask=m)


def decode_inputs(token_buf: torch.Tensor | None, table: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor,
                  slots: torch.Tensor, ids: torch.Tensor, seq_lens: torch.Tensor) -> None:
    """A decode step's inputs from its [n] rows, positions and KV slots, in place and in one launch (the first kernel
    of a decode CUDA graph, cuda_graph.py): ids = token_buf[rows] (unless token_buf is None: the caller wrote the
    ids), seq_lens = positions + 1 and table[rows, positions] = slots. A row repeats at distinct positions (an
    extend replayed as one decode row per token) or as the dummy row (a bucket's padding, whose entries all write
    the same)."""
    n = rows.shape[0]
    if n:
        block = 256
        _decode_inputs_kernel[(triton.cdiv(n, block),)](ids if token_buf is None else token_buf, table, rows,
                                                        positions, slots, ids, seq_lens, n, table.stride(0),
                                                        GATHER=token_buf is not None, BLOCK=block, num_warps=4,
                                                        **pdl_args(rows))
