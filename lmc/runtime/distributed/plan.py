"""Which slice of the model each tensor-parallel rank holds.

Attention is split by KV head group, so every rank's query heads map onto its own KV heads with one group size
(what the attention kernels assume):
- `num_kv_heads >= tp`: the KV heads are dealt out in contiguous runs as even as they can be (uneven when tp does
  not divide them: SmolLM2-135M's 3 KV heads at tp=2 are 2 + 1, so its 9 query heads are 6 + 3), each rank with
  all the query heads of its KV heads.
- `num_kv_heads < tp` (GQA with fewer KV heads than ranks): each KV head is replicated on the ranks that share it,
  and its query heads are split among them.
The MLP's intermediate dimension is split in contiguous runs as even as they can be; the vocabulary in equal
shards of ceil(vocab / tp) rows, the last one padded with zero rows (its padded logits are cut off after the
gather).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass


class TensorParallelError(ValueError):
    """A tensor-parallel size the model (or the machine) cannot take."""


@dataclass(frozen=True)
class ShardPlan:
    """Rank `rank` of `world`: query heads [q0, q1), KV heads [k0, k1), intermediate rows [i0, i1), vocabulary rows
    [v0, v1) of a shard of `vocab_shard` rows (v1 - v0 < vocab_shard on a padded last shard)."""

    rank: int
    world: int
    q0: int
    q1: int
    k0: int
    k1: int
    i0: int
    i1: int
    v0: int
    v1: int
    vocab_shard: int


def _run(n: int, parts: int, p: int) -> tuple[int, int]:
    """Run `p` of [0, n) cut into `parts` contiguous runs whose lengths differ by at most one (longer first)."""
    base, extra = divmod(n, parts)
    lo = p * base + min(p, extra)
    return lo, lo + base + (p < extra)


def plan_shards(cfg, world: int) -> list[ShardPlan]:
    """One plan per rank for a ModelConfig `cfg`; TensorParallelError naming the problem for a size it cannot
    take."""
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise TensorParallelError(f"tensor_parallel_size must be a positive integer, got {world!r}")
    nq, nkv = cfg.num_heads, cfg.num_kv_heads
    if world > nq:
        raise TensorParallelError(f"tensor_parallel_size {world} is more than the model's {nq} attention heads: "
                                  "a rank would hold none")
    if world > cfg.intermediate_size:
        raise TensorParallelError(f"tensor_parallel_size {world} is more than the model's intermediate size "
                                  f"{cfg.intermediate_size}")
    group = nq // nkv
    heads: list[tuple[int, int, int, int]] = []  # (q0, q1, k0, k1) per rank
    if nkv >= world:
        for k0, k1 in (_run(nkv, world, r) for r in range(world)):
            heads.append((k0 * group, k1 * group, k0, k1))
    else:
        # rank r serves KV head r * nkv // world; the ranks sharing a head split its query heads between them
        owner = [r * nkv // world for r in range(world)]
        for r in range(world):
            sharing = [s for s in range(world) if owner[s] == owner[r]]
            lo, hi = _run(group, len(sharing), sharing.index(r))
            q_base = owner[r] * group
            heads.append((q_base + lo, q_base + hi, owner[r], owner[r] + 1))
    shard = -(-cfg.vocab_size // world)
    plans = []
    for r, (q0, q1, k0, k1) in enumerate(heads):
        i0, i1 = _run(cfg.intermediate_size, world, r)
        v0, v1 = min(r * shard, cfg.vocab_size), min((r + 1) * shard, cfg.vocab_size)
        plans.append(ShardPlan(r, world, q0, q1, k0, k1, i0, i1, v0, v1, shard))
    return plans


def local_config(cfg, plan: ShardPlan):
    """The ModelConfig of one rank's slice: the model class builds a rank's shard from it unchanged."""
    return dataclasses.replace(cfg, num_heads=plan.q1 - plan.q0, num_kv_heads=plan.k1 - plan.k0,
                               intermediate_size=plan.i1 - plan.i0, vocab_size=plan.vocab_shard)
