"""Attention backends over the slot-indexed KV cache, and the per-forward batch description they read.

Every backend subclasses `AttentionBackend`: `prepare(batch)` (once per forward: build whatever index/mask tensors
every layer shares) and `forward(q, layer, batch) -> [T, H_q, D]`. The new tokens' K/V are already written to the
cache when it runs. Backends that can run inside a captured decode CUDA graph say so (`supports_cuda_graph`) and
implement the capture / replay hooks that cuda_graph.py calls.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
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
    # Decode: positions [0, shared_prefix) hold the same slots in every request's row (a radix-cache prefix the
    # whole batch shares; each request has keys of its own past it). 0: nothing known. A backend may read it once.
    # In a cascade CUDA graph (cuda_graph.py): an int32 [1] device tensor holding it.
    shared_prefix: Any = 0
    meta: Any = None  # backend-private, set by attn.prepare()
    cos: Any = None  # [T, D] RoPE tables gathered by the model at the start of its forward
    sin: Any = None


class AttentionBackend(ABC):
    """Attention over the KV cache through the slot table.

    Invariants: `forward` reads K/V only at `req_to_token[rows[b], :seq_lens[b]]` (positions past a request's
    length, and the dummy row 0, resolve to slots nobody relies on); it writes nothing but its output.
    """

    # True when prepare_capture() builds metadata that stays valid while only the contents of the batch's tensors
    # change: a decode step can then be captured once per batch size and replayed (cuda_graph.py).
    supports_cuda_graph: bool = False

    @abstractmethod
    def prepare(self, batch: ForwardBatch) -> None:
        """Once per forward, before the first layer: set `batch.meta` to whatever every layer shares."""

    @abstractmethod
    def forward(self, q: torch.Tensor, layer: int, batch: ForwardBatch) -> torch.Tensor:
        """q: [T, H_q, D] -> [T, H_q, D]."""

    def prepare_capture(self, batch: ForwardBatch) -> None:
        """Before capturing a decode graph over `batch`, whose tensors are the graph's static buffers (lengths
        padded, `max_seq_len` the context length). Default: prepare()."""
        self.prepare(batch)

    def reads_shared_prefix(self, batch_size: int, shared_prefix: int, kv_cache) -> bool:
        """Whether a decode of `batch_size` requests sharing `shared_prefix` positions of `kv_cache` reads that
        prefix once for the batch (a CUDA graph replay then takes the bucket's cascade graph). Default: never."""
        return False

    def prepare_replay(self, batch: ForwardBatch, num_real: int) -> None:
        """Before each replay, once the static buffers hold the new step (the first `num_real` rows are real, the
        rest padding on the dummy row). Default: nothing (prepare_capture's metadata is length-independent)."""


def make_backend(name: str, device: torch.device) -> AttentionBackend:
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
