"""Turn a model built from a rank's local config (plan.local_config) into that rank's shard of the whole model.

The decoder's modules stay as they are; what makes them tensor-parallel is added around them:
- qkv_proj and gate_up_proj are column-parallel: the rank's output columns are simply its rows of the weight.
- o_proj and down_proj are row-parallel: a forward hook all-reduces their partial sums.
- embed_tokens becomes a VocabParallelEmbedding (this rank's vocabulary rows; the others' tokens look up zeros,
  and the all-reduce fills them in); the lm-head (or the tied embedding) yields this rank's vocabulary columns,
  and a hook on the model gathers all ranks' columns into the whole logits, which only rank 0 samples from.
Parameter names are unchanged, so the model's own load_weights loads a shard (with `ShardSelector.select`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .plan import ShardPlan


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + rows) of the embedding. Tokens outside them contribute zeros; the all-reduce sums the
    one rank's row each token has (exact: every other term is zero)."""

    def __init__(self, rows: int, dim: int, start: int, comm, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, dim, device=device, dtype=dtype))
        self.start, self.rows, self.comm = start, rows, comm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        h = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.comm.all_reduce(h.masked_fill_(outside[:, None], 0))


def shard_model(model: nn.Module, plan: ShardPlan, vocab_size: int, comm) -> nn.Module:
    """Make `model` (built from local_config(cfg, plan)) rank `plan.rank`'s shard; in place, before its weights
    are loaded. `vocab_size`: the whole model's (the gathered logits are cut to it)."""
    emb = model.embed_tokens
    model.embed_tokens = VocabParallelEmbedding(emb.weight.shape[0], emb.weight.shape[1], plan.v0, comm,
                                                device=emb.weight.device, dtype=emb.weight.dtype)

    def reduce_output(module, args, out):
        return comm.all_reduce(out)

    for layer in model.layers:
        layer.self_attn.o_proj.register_forward_hook(reduce_output)
        layer.mlp.down_proj.register_forward_hook(reduce_output)

    def gather_logits(module, args, logits):
        return comm.all_gather_columns(logits)[:, :vocab_size]

    model.register_forward_hook(gather_logits)
    return model


class ShardSelector:
    """Cuts rank `plan.rank`'s piece out of a whole tensor: a checkpoint tensor in transformers' naming (mapped to
    our parameter and fused-shard index, as LlamaForCausalLM.load_weights does), or a whole fused parameter.
    `obj` may be a torch.Tensor or a safetensors slice (safe_open(...).get_slice): only the piece is read."""

    def __init__(self, plan: ShardPlan, head_dim: int):
        self.plan, self.hd = plan, head_dim

    def select(self, target: str, shard: int | None, obj) -> torch.Tensor:
        p, hd = self.plan, self.hd
        kind = target.split(".")[-2] if "." in target else target
        if kind == "qkv_proj":
            lo, hi = (p.q0 * hd, p.q1 * hd) if shard == 0 else (p.k0 * hd, p.k1 * hd)
            return obj[lo:hi]
        if kind == "gate_up_proj":
            return obj[p.i0:p.i1]
        if kind == "o_proj":
            return obj[:, p.q0 * hd:p.q1 * hd]
        if kind == "down_proj":
            return obj[:, p.i0:p.i1]
        if kind in ("embed_tokens", "lm_head"):
            rows = obj[p.v0:p.v1]
            pad = p.vocab_shard - rows.shape[0]
            return F.pad(rows, (0, 0, 0, pad)) if pad else rows
        return obj[:]

    def select_whole(self, name: str, whole: torch.Tensor, full_sizes: list[int] | None) -> torch.Tensor:
        """The piece of a whole parameter of the unsharded model (`full_sizes`: its fused shards' row counts)."""
        if full_sizes is None:
            return self.select(name, None, whole)
        parts = whole.split(full_sizes, dim=0)
        return torch.cat([self.select(name, i, part) for i, part in enumerate(parts)], dim=0)


@torch.no_grad()
def fill_dummy_sharded(model: nn.Module, full_model: nn.Module, selector: ShardSelector, seed: int = 0) -> None:
    """loader.fill_dummy's values, sharded: parameter i of the whole model (`full_model`, on the meta device: only
    its shapes are read) is drawn whole on this rank's device from the generator seeded `seed + i`, and this
    rank keeps its piece. So a shard holds exactly its slice of the unsharded model's dummy weights."""
    full = dict(full_model.named_parameters())
    for i, (name, p) in enumerate(model.named_parameters()):
        g = torch.Generator(device=p.device).manual_seed(seed + i)
        whole = torch.empty(full[name].shape, dtype=p.dtype, device=p.device).uniform_(-1e-3, 1e-3, generator=g)
        fused = name.split(".")[-2] if "." in name else ""
        sizes = full_model._shard_sizes(fused) if fused in ("qkv_proj", "gate_up_proj") else None
        p.copy_(selector.select_whole(name, whole, sizes))
