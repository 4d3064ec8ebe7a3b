"""The torch definitions of the fused ops (kernels/__init__.py): the CPU path, and the tests' reference. These
are the exact operations llama.py ran before the kernels existed (transformers' LlamaForCausalLM numerics)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def add_rms_norm(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The norm in x's dtype: an fp32 stream's norm rounded for a bf16 x's next linear (kernels.add_rms_norm)."""
    h = residual + x
    return h, rms_norm(h, weight, eps).to(x.dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, H, D]; cos/sin: [T, D] (rotate-half convention, as in transformers)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def rope_qk(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_q_heads: int, num_kv_heads: int,
            head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q, k, v = qkv.split([num_q_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = apply_rope(q.view(-1, num_q_heads, head_dim), cos, sin)
    k = apply_rope(k.view(-1, num_kv_heads, head_dim), cos, sin)
    return q, k, v.view(-1, num_kv_heads, head_dim)


def rope_q_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_q_heads: int, num_kv_heads: int,
                    head_dim: int, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    q, k, v = rope_qk(qkv, cos, sin, num_q_heads, num_kv_heads, head_dim)
    k_cache[slots] = k
    v_cache[slots] = v
    return q


def decode_inputs(token_buf, table, rows, positions, slots, ids, seq_lens) -> None:
    """triton_ops.decode_inputs in torch ops."""
    if token_buf is not None:
        ids.copy_(token_buf[rows])
    seq_lens.copy_(positions + 1)
    table[rows, positions] = slots.to(table.dtype)
