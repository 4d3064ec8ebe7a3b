"""CPU attention: the paged C++ kernel (cpu_kernel.py) reads K and V through the slot table, so a decode step copies
no KV. Extends longer than KERNEL_MAX_EXTEND go to the gather + SDPA reference instead: there one gather is shared by
many query tokens and SDPA's GEMMs beat the kernel's per-token loops."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import AttentionBackend, ForwardBatch
from .torch_backend import TorchAttention

# Longest extend run by the kernel. Not tuned yet: short extends (decode, jump-forward, small chunks) stay on the
# kernel, prompts go to SDPA.
KERNEL_MAX_EXTEND = 64


@dataclass
class _KernelArgs:
    rows: torch.Tensor
    prefix_lens: torch.Tensor
    extend_lens: torch.Tensor
    extend_start: torch.Tensor
    scale: float


class CpuAttention(AttentionBackend):
    def __init__(self, op):
        self.op = op
        self.reference = TorchAttention()

    def prepare(self, batch: ForwardBatch) -> None:
        if batch.max_extend_len > KERNEL_MAX_EXTEND or batch.kv_cache.k[0].dtype != torch.float32:
            self.reference.prepare(batch)
            return
        batch.meta = _KernelArgs(batch.rows.long(), batch.prefix_lens.long(), batch.extend_lens.long(),
                                 batch.extend_start.long(), batch.kv_cache.k[0].shape[-1] ** -0.5)

    def forward(self, q: torch.Tensor, layer: int, batch: ForwardBatch) -> torch.Tensor:
        m = batch.meta
        if not isinstance(m, _KernelArgs):
            return self.reference.forward(q, layer, batch)
        return self.op(q.contiguous(), batch.kv_cache.k[layer], batch.kv_cache.v[layer], batch.req_to_token,
                       m.rows, m.prefix_lens, m.extend_lens, m.extend_start, m.scale)
