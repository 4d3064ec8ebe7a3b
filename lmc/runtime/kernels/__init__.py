"""Fused elementwise kernels of the decoder layer: RMSNorm with the residual add, SiLU-mul, rotary embedding of q
and k in one pass over the QKV projection's output (with the new k and v written into the KV cache in the same
pass, rope_q_write_kv); and the decode-sized linears (`linear`: a Triton skinny GEMM for the shapes where it measured
faster than cuBLAS, skinny_gemm.py), with the MLP's SiLU-mul or the QKV projection's RoPE and KV write in its
epilogue where it serves the shape (linear_silu_mul, linear_rope_q_write_kv).

Each op has one entry point here that takes the Triton kernel (triton_ops.py) for CUDA tensors, the C++ kernel
(attention/cpu_kernel.py: one pass, where the reference takes 5-8 ops a call) for CPU tensors in eager mode (fp32,
or bf16 activations between fp32 weights: the bf16 linears of model/linear.py),
and the torch reference (reference.py) otherwise: torch.compile's view of the CPU forward is the plain torch ops
they always were, which inductor fuses itself. The Triton kernels round where the torch ops round (to the
activation dtype after each op) so that GPU results stay within an ulp of the reference rather than merely within
bf16 noise.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import reference


def _fused(x: torch.Tensor) -> bool:
    return x.is_cuda


_cpu_lib: list = []  # [torch.ops.lmc_cpu, or None where it cannot be built] once looked up


# The dtypes of an activation (a linear's output) that the C++ kernels read: bf16 is a bf16 linear's output, which
# they widen exactly (attention/cpu_kernel.py).
_CPU_ACTIVATIONS = (torch.float32, torch.bfloat16)


def _cpu_ops(x: torch.Tensor, *fp32: torch.Tensor):
    """The C++ CPU kernels (attention/cpu_kernel.py) for a CPU activation `x` in fp32 or bf16 whose other operands
    `fp32` (weights, the residual stream, the RoPE tables) are fp32, outside torch.compile; else None (inductor fuses
    the reference ops itself, and a model run wholly in bf16 or fp16 keeps the reference's roundings)."""
    if (not x.is_cpu or x.dtype not in _CPU_ACTIVATIONS or any(t.dtype != torch.float32 for t in fp32)
            or torch.compiler.is_compiling()):
        return None
    if not _cpu_lib:
        from ..attention.cpu_kernel import elementwise

        _cpu_lib.append(elementwise())
    return _cpu_lib[0]


def fuses_kv_write(x: torch.Tensor) -> bool:
    """Whether the caller hands RoPE and the KV write of the QKV projection of `x` (its input or its output: both
    are fp32 or bf16 activations alike) to rope_q_write_kv (one kernel, where the cache is fp32 on the CPU; with the
    GEMM in it on CUDA, linear_rope_q_write_kv), or keeps them apart, as the compiled CPU forward does so that the
    write stays outside torch.compile's graphs."""
    return _fused(x) or _cpu_ops(x) is not None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias); on CUDA for a decode-sized x, the skinny GEMM where it is the faster kernel."""
    if bias is None and _fused(x):
        from . import skinny_gemm

        cfg = skinny_gemm.config_for(x.numel() // x.shape[-1], weight.shape[0], weight.shape[1])
        if cfg is not None:
            return skinny_gemm.skinny_gemm(x, weight, cfg)
    return F.linear(x, weight, bias)


# Whether linear_silu_mul fuses the SiLU-mul into the skinny GEMM (an A/B switch: benchmarks/gpu_step_ab.py; read at
# each call, so CUDA graphs captured after a change take the new value).
FUSE_SILU_MUL = True


def linear_silu_mul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """silu_mul(linear(x, weight)) for the MLP's gate_up weight [2I, K] (gate rows, then up rows): one kernel on
    CUDA where the gated skinny GEMM measured faster than the two (skinny_gemm.GATED_CONFIGS), else the two ops."""
    if FUSE_SILU_MUL and _fused(x):
        from . import skinny_gemm

        cfg = skinny_gemm.config_for(x.numel() // x.shape[-1], weight.shape[0], weight.shape[1], gated=True)
        if cfg is not None:
            return skinny_gemm.skinny_gemm(x, weight, cfg, gated=True)
    return silu_mul(linear(x, weight))


# Whether linear_rope_q_write_kv fuses RoPE and the KV write into the skinny GEMM (an A/B switch, as FUSE_SILU_MUL).
FUSE_ROPE = True


def linear_rope_q_write_kv(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                           num_q_heads: int, num_kv_heads: int, head_dim: int, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """rope_q_write_kv(linear(x, weight), ...) for the fused QKV weight: one kernel on CUDA where the skinny GEMM
    with its RoPE epilogue (q and k rotated, k and v written into the cache) measured faster
    (skinny_gemm.rope_config_for), else the two."""
    if FUSE_ROPE and _fused(x):
        from . import skinny_gemm

        cfg = skinny_gemm.rope_config_for(x.numel() // x.shape[-1], weight.shape[0], weight.shape[1], head_dim)
        if cfg is not None:
            return skinny_gemm.skinny_gemm_rope(x, weight, cfg, cos, sin, num_q_heads, num_kv_heads, head_dim,
                                                k_cache, v_cache, slots)
    return rope_q_write_kv(linear(x, weight), cos, sin, num_q_heads, num_kv_heads, head_dim, k_cache, v_cache,
                           slots)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / rms(x)), the normalisation in fp32 and the product in x's dtype (transformers' LlamaRMSNorm)."""
    if _fused(x):
        from . import triton_ops

        return triton_ops.rms_norm(x, weight, eps)
    cpu = _cpu_ops(x, x, weight)  # x among the fp32 operands: the C++ rms_norm reads fp32 (the embeddings) only
    if cpu is not None:
        return cpu.rms_norm(x.contiguous(), weight, eps)
    return reference.rms_norm(x, weight, eps)


def add_rms_norm(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, rms_norm(h)) for h = residual + x: the residual stream and the next sublayer's input, in one pass. The
    norm comes in x's dtype (h in residual's): a bf16 x (a bf16 linear's output) gives the next linear its bf16
    input."""
    if _fused(x):
        from . import triton_ops

        return triton_ops.add_rms_norm(residual, x, weight, eps)
    cpu = _cpu_ops(x, residual, weight)
    if cpu is not None:
        return cpu.add_rms_norm(residual.contiguous(), x.contiguous(), weight, eps)
    return reference.add_rms_norm(residual, x, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate | up) -> [T, I] silu(gate) * up, in gate_up's dtype."""
    if _fused(gate_up):
        from . import triton_ops

        return triton_ops.silu_mul(gate_up)
    cpu = _cpu_ops(gate_up)
    if cpu is not None:
        return cpu.silu_mul(gate_up.contiguous())
    return reference.silu_mul(gate_up)


def rope_qk(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_q_heads: int, num_kv_heads: int,
            head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split the QKV projection's [T, (Hq + 2 Hkv) D] output into q [T, Hq, D], k, v [T, Hkv, D], with rotate-half
    RoPE applied to q and k (cos/sin: [T, D], already gathered at the tokens' positions). v is a view of qkv."""
    if _fused(qkv):
        from . import triton_ops

        return triton_ops.rope_qk(qkv, cos, sin, num_q_heads, num_kv_heads, head_dim)
    return reference.rope_qk(qkv, cos, sin, num_q_heads, num_kv_heads, head_dim)


@torch.compiler.disable  # in-place writes into the cache: kept out of graphs (as llama.attend is)
def rope_q_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_q_heads: int, num_kv_heads: int,
                    head_dim: int, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """rope_qk, with the rotated k and v written straight into one layer's KV cache at `slots` ([T] int64) instead
    of being returned: returns q. One kernel on CUDA and on the CPU (with an fp32 cache; qkv fp32 or bf16, q then
    fp32); the torch reference (rope, then two index writes) else."""
    if _fused(qkv):
        from . import triton_ops

        return triton_ops.rope_q_write_kv(qkv, cos, sin, num_q_heads, num_kv_heads, head_dim, k_cache, v_cache, slots)
    cpu = _cpu_ops(qkv, cos, sin, k_cache, v_cache)
    if cpu is not None and head_dim == cos.shape[-1]:
        return cpu.rope_q_write_kv(qkv.contiguous(), cos.contiguous(), sin.contiguous(), num_q_heads, num_kv_heads,
                                   k_cache, v_cache, slots.long().contiguous())
    return reference.rope_q_write_kv(qkv, cos, sin, num_q_heads, num_kv_heads, head_dim, k_cache, v_cache, slots)
