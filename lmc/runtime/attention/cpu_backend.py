"""CPU attention: the paged C++ kernel (cpu_kernel.py) reads K and V through the slot table, so a decode step copies
no KV. Requests whose extend is longer than KERNEL_MAX_EXTEND go to SDPA instead, one request at a time over its own
gathered keys: there one gather is shared by many query tokens and SDPA's GEMMs beat the kernel's per-token loops.
One call per request, not one padded batch: a prefill batch of 49 64-token questions and one 512-token chunk padded
every question to 512 queries (8x the work; 21 s of a 38 s shared-prefix run)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import AttentionBackend, ForwardBatch
from .torch_backend import TorchAttention

# Longest extend run by the kernel (the batch's longest decides for all of it). Measured on this machine (1 thread,
# 8 requests over 512-token prefixes, 9:3 heads of 64): the kernel takes 0.6x SDPA's time at extends of 2, 0.85x at
# 8, 2.3x at 16 and 3.7x at 64; decode (extend 1) 0.3x. So decode, jump-forward and short chunks stay on the
# kernel, and a question after a cached system prompt goes to SDPA.
KERNEL_MAX_EXTEND = 8


@dataclass
class _KernelArgs:
    rows: torch.Tensor
    prefix_lens: torch.Tensor
    extend_lens: torch.Tensor
    extend_start: torch.Tensor
    scale: float


@dataclass
class _Long:
    """One request past KERNEL_MAX_EXTEND: its tokens [start, start + n), keys at `key_slots` [seq], and the causal
    mask [n, seq] (True: may attend)."""

    start: int
    n: int
    key_slots: torch.Tensor
    mask: torch.Tensor


@dataclass
class _Mixed:
    """A batch with long extends: the kernel for the short requests (over their tokens `short_tokens`, gathered),
    SDPA for each long one."""

    short_tokens: torch.Tensor | None
    short: _KernelArgs | None
    long: list[_Long]


class CpuAttention(AttentionBackend):
    def __init__(self, op):
        self.op = op
        self.reference = TorchAttention()

    def prepare(self, batch: ForwardBatch) -> None:
        if batch.kv_cache.k[0].dtype != torch.float32:
            self.reference.prepare(batch)
            return
        scale = batch.kv_cache.k[0].shape[-1] ** -0.5
        if batch.max_extend_len <= KERNEL_MAX_EXTEND:
            batch.meta = _KernelArgs(batch.rows.long(), batch.prefix_lens.long(), batch.extend_lens.long(),
                                     batch.extend_start.long(), scale)
            return
        ext, pre, starts = batch.extend_lens.tolist(), batch.prefix_lens.tolist(), batch.extend_start.tolist()
        short = [i for i, e in enumerate(ext) if e <= KERNEL_MAX_EXTEND]
        long = []
        for i, e in enumerate(ext):
            if e > KERNEL_MAX_EXTEND:
                seq = pre[i] + e
                mask = torch.arange(seq)[None, :] <= torch.arange(pre[i], seq)[:, None]
                long.append(_Long(starts[i], e, batch.req_to_token[batch.rows[i], :seq].long(), mask))
        tokens, args = None, None
        if short:
            idx = torch.tensor(short)
            tokens = torch.cat([torch.arange(starts[i], starts[i] + ext[i]) for i in short])
            lens = batch.extend_lens[idx].long()
            args = _KernelArgs(batch.rows[idx].long(), batch.prefix_lens[idx].long(), lens,
                               torch.cumsum(lens, 0) - lens, scale)
        batch.meta = _Mixed(tokens, args, long)

    def forward(self, q: torch.Tensor, layer: int, batch: ForwardBatch) -> torch.Tensor:
        m = batch.meta
        k_cache, v_cache = batch.kv_cache.k[layer], batch.kv_cache.v[layer]
        if isinstance(m, _KernelArgs):
            return self._kernel(q.contiguous(), k_cache, v_cache, batch, m)
        if not isinstance(m, _Mixed):
            return self.reference.forward(q, layer, batch)
        out = torch.empty_like(q)
        if m.short is not None:
            out[m.short_tokens] = self._kernel(q[m.short_tokens], k_cache, v_cache, batch, m.short)
        for r in m.long:
            qr = q[r.start:r.start + r.n].transpose(0, 1)[None]  # [1, H, n, D]
            k, v = k_cache[r.key_slots].transpose(0, 1)[None], v_cache[r.key_slots].transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(qr, k, v, attn_mask=r.mask, enable_gqa=k.shape[1] != qr.shape[1])
            out[r.start:r.start + r.n] = o[0].transpose(0, 1)
        return out

    def _kernel(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch,
                m: _KernelArgs) -> torch.Tensor:
        return self.op(q, k_cache, v_cache, batch.req_to_token, m.rows, m.prefix_lens, m.extend_lens,
                       m.extend_start, m.scale)
