"""Fused elementwise kernels of the decoder layer: RMSNorm with the residual add, SiLU-mul, rotary embedding of q
and k in one pass over the QKV projection's output (with the new k and v written into the KV cache in the same
pass, rope_q_write_kv); and the decode-sized linears (`linear`: a Triton skinny GEMM for the shapes where it measured
faster than cuBLAS, skinny_gemm.py), with the MLP's SiLU-mul or the QKV projection's RoPE and KV write in its
epilogue where it serves the shape, and the RMSNorm before either in its operand load where K is small
(norm_linear_silu_mul, norm_linear_rope_q_write_kv: their input is a PendingNorm).

Each op has one entry point here that takes the Triton kernel (triton_ops.py) for CUDA tensors, the C++ kernel
(attention/cpu_kernel.py: one pass, where the reference takes 5-8 ops a call) for CPU tensors in eager mode (fp32,
or bf16 activations between fp32 weights: the bf16 linears of model/linear.py),
and the torch reference (reference.py) otherwise: torch.compile's view of the CPU forward is the plain torch ops
they always were, which inductor fuses itself. The Triton kernels round where the torch ops round (to the
activation dtype after each op) so that GPU results stay within an ulp of the reference rather than merely within
bf16 noise.
"""
from __future__ import annotations

from dataclasses import dataclass

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
    GEMM in it on CUDA, norm_linear_rope_q_write_kv), or keeps them apart, as the compiled CPU forward does so that the
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


@dataclass(frozen=True)
class PendingNorm:
    """A sublayer's input, not yet computed: rms_norm(residual + x) with `weight` (of x alone where residual is None:
    the first layer's embeddings), whose sum residual + x is the residual stream. The sublayer's first linear takes
    it (norm_linear_silu_mul, norm_linear_rope_q_write_kv): on CUDA its skinny GEMM normalizes in the operand load
    where it serves the shape and K is at most NORM_MAX_K (one launch less a sublayer); elsewhere `apply` runs the
    norm's own kernel first. Either way the caller gets the stream back with the linear's output."""
    residual: torch.Tensor | None
    x: torch.Tensor
    weight: torch.Tensor
    eps: float

    def apply(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(the residual stream, the norm), as add_rms_norm computes them (rms_norm without a residual)."""
        if self.residual is None:
            return self.x, rms_norm(self.x, self.weight, self.eps)
        return add_rms_norm(self.residual, self.x, self.weight, self.eps)


# Whether the skinny GEMM computes a PendingNorm in its operand load (an A/B switch, as FUSE_SILU_MUL), and up to
# which K: each of its programs first re-reads its rows over all of K for their statistics, which costs little at
# SmolLM2's K = 576 (its decode graph replayed with every norm skipped: 0.778 against 0.933 ms at batch 1 on an
# H100, results/h100_probe/fusion_bound_smollm2.json) and much at a 7B's 4096 (1.6x slower steps:
# results/h200_probe/step_ab6_norm_in_gemm.json).
FUSE_NORM = True
NORM_MAX_K = 1024


def _skinny(launch, pre: PendingNorm, weight: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """(stream, launch(input, weight, *args, **kwargs)) for a skinny_gemm launch: the norm in its operand load where
    FUSE_NORM and NORM_MAX_K allow, else its own kernel first."""
    if FUSE_NORM and weight.shape[1] <= NORM_MAX_K:
        return launch(pre.x, weight, *args, norm=(pre.residual, pre.weight, pre.eps), **kwargs)
    stream, x = pre.apply()
    return stream, launch(x, weight, *args, **kwargs)


# Whether norm_linear_silu_mul fuses the SiLU-mul into the skinny GEMM (an A/B switch: benchmarks/gpu_step_ab.py;
# read at each call, so CUDA graphs captured after a change take the new value).
FUSE_SILU_MUL = True


def norm_linear_silu_mul(pre: PendingNorm, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(stream, silu_mul(linear(norm, weight))) for the MLP's gate_up weight [2I, K] (gate rows, then up rows) and
    its input `pre`: one kernel on CUDA where the gated skinny GEMM measured faster than the product and silu_mul
    (skinny_gemm.GATED_CONFIGS), the norm in it as PendingNorm says; else the ops apart."""
    if _fused(pre.x):
        from . import skinny_gemm

        m, (n, k) = pre.x.numel() // pre.x.shape[-1], weight.shape
        gated = FUSE_SILU_MUL and skinny_gemm.config_for(m, n, k, gated=True)
        cfg = gated or skinny_gemm.config_for(m, n, k)
        if cfg is not None:
            stream, y = _skinny(skinny_gemm.skinny_gemm, pre, weight, cfg, gated=bool(gated))
            return stream, y if gated else silu_mul(y)
    stream, x = pre.apply()
    return stream, silu_mul(linear(x, weight))


# Whether norm_linear_rope_q_write_kv fuses RoPE and the KV write into the skinny GEMM (an A/B switch, as
# FUSE_SILU_MUL).
FUSE_ROPE = True


def norm_linear_rope_q_write_kv(pre: PendingNorm, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                                num_q_heads: int, num_kv_heads: int, head_dim: int, k_cache: torch.Tensor,
                                v_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(stream, rope_q_write_kv(linear(norm, weight), ...)) for the fused QKV weight and its input `pre`: one kernel
    on CUDA where the skinny GEMM with its RoPE epilogue (q and k rotated, k and v written into the cache) measured
    faster (skinny_gemm.rope_config_for), the norm in it as PendingNorm says; else the ops apart."""
    args = (cos, sin, num_q_heads, num_kv_heads, head_dim, k_cache, v_cache, slots)
    if FUSE_ROPE and _fused(pre.x):
        from . import skinny_gemm

        cfg = skinny_gemm.rope_config_for(pre.x.numel() // pre.x.shape[-1], weight.shape[0], weight.shape[1],
                                          head_dim)
        if cfg is not None:
            return _skinny(skinny_gemm.skinny_gemm_rope, pre, weight, cfg, *args)
    stream, x = pre.apply()
    return stream, rope_q_write_kv(linear(x, weight), *args)


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
