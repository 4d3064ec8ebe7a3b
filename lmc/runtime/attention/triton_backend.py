"""GPU attention: Triton extend and decode kernels reading K/V through the slot table (no gather copies).
Under TRITON_INTERPRET=1 the same kernels run on CPU, which is how CI checks them."""
from __future__ import annotations

import torch

from . import AttentionBackend, ForwardBatch
from .triton_kernels import decode_attention, extend_attention


class TritonAttention(AttentionBackend):
    # prepare() derives nothing from the batch's lengths, so a decode forward can be captured in a CUDA graph
    # and replayed with new lengths written into the same tensors.
    supports_cuda_graph = True

    def prepare(self, batch: ForwardBatch) -> None:
        batch.meta = batch.kv_cache.k[0].shape[-1] ** -0.5

    def forward(self, q: torch.Tensor, layer: int, batch: ForwardBatch) -> torch.Tensor:
        k, v, scale = batch.kv_cache.k[layer], batch.kv_cache.v[layer], batch.meta
        if batch.is_decode:
            return decode_attention(q, k, v, batch.req_to_token, batch.rows, batch.seq_lens, scale,
                                    max_seq_len=batch.max_seq_len)
        return extend_attention(q, k, v, batch.req_to_token, batch.rows, batch.prefix_lens, batch.extend_lens,
                                batch.extend_start, batch.max_extend_len, scale)
