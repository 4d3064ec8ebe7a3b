"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral; Qwen2 through q/k/v bias) over the slot-indexed KV cache.

The forward takes a flat batch: all tokens of all requests in one [T] vector, with positions and the KV slots
their keys and values are written to. Attention goes through a backend that reads earlier tokens by slot.
Numerics follow transformers' LlamaForCausalLM (fp32 RMSNorm, rotate-half RoPE, fp32 softmax) so that greedy
tokens and logprobs match it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from .linear import Linear


@dataclass(frozen=True)
class ModelConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    max_position: int
    tie_word_embeddings: bool
    qkv_bias: bool
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_hf(cls, hf) -> "ModelConfig":
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        eos = hf.eos_token_id if isinstance(hf.eos_token_id, list) else [hf.eos_token_id]
        return cls(
            hidden_size=hf.hidden_size, num_layers=hf.num_hidden_layers, num_heads=hf.num_attention_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads, head_dim=head_dim,
            intermediate_size=hf.intermediate_size, vocab_size=hf.vocab_size, rms_norm_eps=hf.rms_norm_eps,
            max_position=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=bool(getattr(hf, "attention_bias", False) or hf.model_type == "qwen2"),
            eos_token_ids=tuple(t for t in eos if t is not None),
        )


def rope_cos_sin(hf_config, max_position: int, device, dtype) -> torch.Tensor:
    """cos/sin table [max_position, head_dim] x2, from transformers' own RoPE initialisation (all rope types)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rope = LlamaRotaryEmbedding(hf_config)
    freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * rope.inv_freq.float()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    scale = rope.attention_scaling
    return torch.stack([emb.cos() * scale, emb.sin() * scale]).to(device=device, dtype=dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps)

    def add(self, residual: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual + x, its norm): the residual add fused into the norm that reads it."""
        return kernels.add_rms_norm(residual, x, self.weight, self.eps)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_id: int, ctx) -> torch.Tensor:
    """Write the new tokens' K/V into the slot-indexed pool, then attend. Kept outside any torch.compile graph
    (compiled.py wraps it in torch.compiler.disable; not here, since that decorator imports dynamo, seconds of
    every start): the in-place writes into the pool would be functionalized into copies of whole buffers, and
    the backends' kernels are fused already."""
    ctx.kv_cache.write(layer_id, ctx.out_slots, k, v)
    return ctx.attn.forward(q, layer_id, ctx)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.nq, self.nkv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        # q, k and v in one GEMM: one weight read per step instead of three.
        self.qkv_proj = Linear(cfg.hidden_size, (self.nq + 2 * self.nkv) * self.hd, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.nq * self.hd, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, ctx) -> torch.Tensor:
        if kernels.fuses_kv_write(x):  # RoPE and the KV-cache write in one kernel (with the GEMM, where it can)
            kv = ctx.kv_cache
            q = self.qkv_proj.rope_q_write_kv(x, ctx.cos, ctx.sin, self.nq, self.nkv, self.hd, kv.k[self.layer_id],
                                              kv.v[self.layer_id], ctx.out_slots)
            o = ctx.attn.forward(q, self.layer_id, ctx)
        else:
            q, k, v = kernels.rope_qk(self.qkv_proj(x), ctx.cos, ctx.sin, self.nq, self.nkv, self.hd)
            o = attend(q, k, v, self.layer_id, ctx)
        return self.o_proj(o.reshape(-1, self.nq * self.hd))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.silu_mul(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_id)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, ctx) -> tuple[torch.Tensor, torch.Tensor]:
        """h: the previous layer's MLP output, not yet added to the residual stream (layer 0: the embeddings, with
        `residual` None). Returns this layer's MLP output and the stream before it: each residual add happens
        inside the norm that reads its result (the sums, and so the numerics, are transformers' own)."""
        if residual is None:
            residual, x = h, self.input_layernorm(h)
        else:
            residual, x = self.input_layernorm.add(residual, h)
        residual, x = self.post_attention_layernorm.add(residual, self.self_attn(x, ctx))
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    # transformers' separate projections -> our fused parameter, and the shard's index within it.
    _FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
              "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        # _weight: no random init of a table that is loaded next (as Linear, which allocates without init)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.rope: torch.Tensor | None = None  # [2, max_position, head_dim], set by the runner (rope_cos_sin)

    def tie_weights(self) -> None:
        """With tied embeddings, the lm-head's weight is the embedding's one parameter (named and loaded as the
        embedding's). Again after anything that replaces parameters (`to_empty`, a vocabulary-parallel embedding)."""
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, ctx) -> torch.Tensor:
        """Returns logits (fp32) for the token positions in `ctx.logits_index` only (a decode's are all its rows, in
        order: the runner samples every request of a decode step and asks no prompt logprobs of it)."""
        ctx.cos, ctx.sin = self.rope[:, ctx.positions].unbind(0)  # one gather for both tables
        h, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            h, residual = layer(h, residual, ctx)
        if not ctx.is_decode:  # the last add at logit rows only; a decode step (a CUDA graph's too) gathers nothing
            residual, h = residual[ctx.logits_index], h[ctx.logits_index]
        _, h = self.norm.add(residual, h)
        return self.lm_head(h).float()

    def _shard_sizes(self, fused: str) -> list[int]:
        c = self.cfg
        if fused == "qkv_proj":
            return [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim]
        return [c.intermediate_size, c.intermediate_size]

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], select=None) -> None:
        """Load transformers-named tensors (`model.layers.0.self_attn.q_proj.weight`, ...). Every parameter must
        be covered, so a wrong checkpoint fails here rather than producing garbage.
        `select(target, shard, tensor)`: this tensor-parallel rank's piece of a tensor (distributed/layers.py);
        the tensors may then be lazy safetensors slices."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
                continue  # tied to the embedding
            parts = name.split(".")
            target, shard = name, None
            for i, part in enumerate(parts):
                if part in self._FUSED:
                    fused, shard = self._FUSED[part]
                    target = ".".join(parts[:i] + [fused] + parts[i + 1:])
            if target not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no place in the model")
            param = params[target]
            if select is not None:
                tensor = select(target, shard, tensor)
            if shard is None:
                param.copy_(tensor)
            else:
                sizes = self._shard_sizes(target.split(".")[-2])
                param.narrow(0, sum(sizes[:shard]), sizes[shard]).copy_(tensor)
            loaded.add(f"{target}#{shard}")
        expected = set()
        for pname in params:
            fused = pname.split(".")[-2]
            n = len(self._shard_sizes(fused)) if fused in ("qkv_proj", "gate_up_proj") else 0
            expected |= {f"{pname}#{s}" for s in range(n)} if n else {f"{pname}#None"}
        missing = expected - loaded
        if missing:
            raise KeyError(f"checkpoint lacks {len(missing)} tensor(s), e.g. {sorted(missing)[:3]}")
