"""GPU attention: Triton extend and decode kernels reading K/V through the slot table (no gather copies).
Under TRITON_INTERPRET=1 the same kernels run on CPU, which is how CI checks them."""
from __future__ import annotations

import torch

from . import AttentionBackend, ForwardBatch
from .triton_kernels import decode_attention, extend_attention


# The cascade (decode_attention's shared_prefix) is taken where the K/V re-reads it saves, (batch - 1) x prefix
# tokens of every layer, come to at least this many bytes: 4 GB, ~1 ms of the H200's copy bandwidth, against its
# costs (a prefix kernel and the merge in every layer; a second CUDA graph of the bucket, captured on first use).
# gpu_bench's few-shot decode (127 x 1,200 tokens of llama-2-7b's 0.5 MB per token) saves 80 GB a step; a 4-way
# fork of a 1,000-token prompt (1.5 GB) does without.
SHARED_PREFIX_MIN_BYTES = 4 << 30


class TritonAttention(AttentionBackend):
    # prepare() derives nothing from the batch's lengths, so a decode forward can be captured in a CUDA graph
    # and replayed with new lengths written into the same tensors.
    supports_cuda_graph = True

    def reads_shared_prefix(self, batch_size: int, shared_prefix: int, kv_cache) -> bool:
        k = kv_cache.k
        kv_bytes_per_token = 2 * len(k) * k[0][0].numel() * k[0].element_size()  # every layer's K and V
        return shared_prefix > 0 and (batch_size - 1) * shared_prefix * kv_bytes_per_token >= SHARED_PREFIX_MIN_BYTES

    def prepare(self, batch: ForwardBatch) -> None:
        prefix = batch.shared_prefix
        # A device tensor: a cascade graph's (cuda_graph.py), which took the decision and holds the length.
        if not isinstance(prefix, torch.Tensor) and not (
                batch.is_decode and self.reads_shared_prefix(len(batch.rows), prefix, batch.kv_cache)):
            prefix = 0
        batch.meta = (batch.kv_cache.k[0].shape[-1] ** -0.5, prefix)

    def forward(self, q: torch.Tensor, layer: int, batch: ForwardBatch) -> torch.Tensor:
        k, v, (scale, shared_prefix) = batch.kv_cache.k[layer], batch.kv_cache.v[layer], batch.meta
        if batch.is_decode:
            return decode_attention(q, k, v, batch.req_to_token, batch.rows, batch.seq_lens, scale,
                                    max_seq_len=batch.max_seq_len, shared_prefix=shared_prefix)
        return extend_attention(q, k, v, batch.req_to_token, batch.rows, batch.prefix_lens, batch.extend_lens,
                                batch.extend_start, batch.max_extend_len, scale)
