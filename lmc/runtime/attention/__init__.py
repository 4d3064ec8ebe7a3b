"""Attention backends over the slot-indexed KV cache, and the per-forward batch description they read.

A backend has `prepare(batch)` (once per forward: build whatever index/mask tensors every layer shares) and
`forward(q, layer, batch) -> [T, H_q, D]`. The new tokens' K/V are already written to the cache when it runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class ForwardBatch:
    """One forward over B requests and T = sum(extend_lens) new tokens (T == B when decoding)."""

    is_decode: bool
    rows: torch.Tensor  # [B] slot-table rows
    prefix_lens: torch.Tensor  # [B] tokens with KV before this forward
    extend_lens: torch.Tensor  # [B] new tokens per request
    seq_lens: torch.Tensor  # [B] prefix + extend
    extend_start: torch.Tensor  # [B] offset of each request's first new token in the flat [T] order
    max_extend_len: int
    max_seq_len: int
    positions: torch.Tensor  # [T]
    out_slots: torch.Tensor  # [T] KV slot each new token writes
    logits_index: torch.Tensor  # [K] flat positions whose logits the caller needs
    kv_cache: Any
    req_to_token: torch.Tensor
    attn: Any
    meta: Any = None  # backend-private, set by attn.prepare()
    cos: Any = None  # [T, D] RoPE tables gathered by the model at the start of its forward
    sin: Any = None


def make_backend(name: str, device: torch.device):
    """`auto`: Triton on the GPU; on the CPU the paged C++ kernel, or the torch reference where it cannot be built."""
    if name == "auto":
        name = "triton" if device.type == "cuda" else "cpu"
    if name == "cpu":
        from .cpu_backend import CpuAttention
        from .cpu_kernel import load

        op = load()  # None (and a warning) without a working C++ toolchain
        if op is not None:
            return CpuAttention(op)
        name = "torch"
    if name == "torch":
        from .torch_backend import TorchAttention

        return TorchAttention()
    if name == "triton":
        from .triton_backend import TritonAttention

        return TritonAttention()
    raise ValueError(f"unknown attention backend {name!r}; choose 'cpu', 'torch', 'triton' or 'auto'")
