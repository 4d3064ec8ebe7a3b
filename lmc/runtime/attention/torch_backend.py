"""Reference attention in plain torch (runs on CPU): gather each request's keys by slot into a padded
[B, K_max] batch and run one SDPA call per layer with a position mask. Padding reads the dummy slot 0."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import AttentionBackend, ForwardBatch


@dataclass
class _Meta:
    q_index: torch.Tensor  # [B, Q_max] flat token index of each padded query (0 for padding)
    q_valid: torch.Tensor  # [B * Q_max] which padded queries are real, in flat order
    key_slots: torch.Tensor  # [B, K_max]
    mask: torch.Tensor  # [B, 1, Q_max, K_max] True where the query may attend the key


class TorchAttention(AttentionBackend):
    def prepare(self, batch: ForwardBatch) -> None:
        dev = batch.rows.device
        qmax, kmax = batch.max_extend_len, batch.max_seq_len
        qpos = torch.arange(qmax, device=dev)[None, :]
        q_real = qpos < batch.extend_lens[:, None]
        q_index = torch.where(q_real, batch.extend_start[:, None] + qpos, 0)
        key_slots = batch.req_to_token[batch.rows, :kmax].long()
        kpos = torch.arange(kmax, device=dev)[None, None, :]
        abs_qpos = (batch.prefix_lens[:, None] + qpos)[:, :, None]  # [B, Q_max, 1]
        mask = (kpos <= abs_qpos) & (kpos < batch.seq_lens[:, None, None])
        mask[..., 0] |= ~q_real  # padded queries attend the dummy key instead of nothing (no NaN rows)
        batch.meta = _Meta(q_index, q_real.reshape(-1), key_slots, mask[:, None])

    def forward(self, q: torch.Tensor, layer: int, batch: ForwardBatch) -> torch.Tensor:
        m: _Meta = batch.meta
        b, qmax = m.q_index.shape
        # Decode has one query per request and no padding: a view, not a gather.
        qp = (q[:, None] if batch.is_decode else q[m.q_index]).transpose(1, 2)  # [B, H, Q_max, D]
        k = batch.kv_cache.k[layer][m.key_slots].transpose(1, 2)  # [B, H_kv, K_max, D]
        v = batch.kv_cache.v[layer][m.key_slots].transpose(1, 2)
        o = F.scaled_dot_product_attention(qp, k, v, attn_mask=m.mask, enable_gqa=k.shape[1] != qp.shape[1])
        o = o.transpose(1, 2).reshape(b * qmax, *q.shape[1:])
        return o if batch.is_decode else o[m.q_valid]
