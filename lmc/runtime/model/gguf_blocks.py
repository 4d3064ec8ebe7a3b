"""A GGUF's block-quantized linear weights (Q4_1, Q8_0) kept as they are stored, for the CPU's block panels.

A GGUF model is dequantized once into an fp32 checkpoint (loader.py), which the model loads; a CPU decode step then
streams 4 bytes a weight, where the file holds 0.625 (Q4_1) or 1.0625 (Q8_0). `checked_gguf_blocks(model, path)`
reads the file's blocks of each linear (fused as the model fuses them: q, k, v; gate, up) for `Linear.prepack`,
whose kernel dequantizes them in registers or a few KB at a time into L1 (attention/cpu_kernel.py,
`block_panel_linear`). A block's weight is d * q + m, computed exactly as gguf-py computes the checkpoint's, so a
layer takes its blocks only where they dequantize to its loaded weight bit for bit (checked here, layer by layer):
outputs are the same with blocks or without; only the bytes a step reads change.

The embedded SmolLM2-135M-Instruct: 106M Q4_1 weights in the layers, its tied lm-head the Q8_0 embedding table;
540 MB of fp32 panels become 96 MB of blocks.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .linear import Linear

log = logging.getLogger(__name__)

BLOCK = 32  # weights per quantization block, along the input dimension
_Q4_1, _Q8_0 = 3, 8  # ggml's type ids (gguf.GGMLQuantizationType)
_BLOCK_BYTES = {_Q4_1: 20, _Q8_0: 34}  # fp16 d (and fp16 m: Q4_1), then the codes
_BITS = {_Q4_1: 4, _Q8_0: 8}
# transformers' names (one fused Linear takes several, in this order) -> the GGUF's, with `{i}` the layer
_LAYER_PARTS = {"self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"), "self_attn.o_proj": ("attn_output",),
                "mlp.gate_up_proj": ("ffn_gate", "ffn_up"), "mlp.down_proj": ("ffn_down",)}


@dataclass
class Blocks:
    """One weight [N, K] in blocks of 32 along K: `codes` uint8 [N, K] (Q4_1: 0..15; Q8_0: int8 as bytes),
    `scales` and `mins` fp32 [N, K / 32] (mins 0 for Q8_0); the weight is scales * codes + mins, blockwise."""

    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor
    bits: int

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight, as gguf-py computes it (d * q is exact in fp32; + m rounds once)."""
        q = self.codes.view(torch.int8) if self.bits == 8 else self.codes
        n, k = self.codes.shape
        w = q.float().view(n, k // BLOCK, BLOCK) * self.scales[..., None] + self.mins[..., None]
        return w.view(n, k)

    @staticmethod
    def cat(parts: list["Blocks"]) -> "Blocks":
        return Blocks(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]),
                      torch.cat([p.mins for p in parts]), parts[0].bits)


def read_blocks(raw: np.ndarray, kind: int) -> Blocks:
    """A GGUF tensor's bytes [N, K / 32 * block bytes] (Q4_1 or Q8_0) as Blocks."""
    n = raw.shape[0]
    blocks = raw.reshape(n, -1, _BLOCK_BYTES[kind])
    scales = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    if kind == _Q4_1:
        mins = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        qs = blocks[..., 4:]  # byte j: weight j in the low nibble, weight j + 16 in the high one
        codes = np.concatenate([qs & 15, qs >> 4], axis=-1)
    else:
        mins = np.zeros_like(scales)
        codes = blocks[..., 2:]
    return Blocks(torch.from_numpy(np.ascontiguousarray(codes).reshape(n, -1)), torch.from_numpy(scales),
                  torch.from_numpy(mins), _BITS[kind])


def rope_row_order(n: int, heads: int) -> np.ndarray:
    """The rows of transformers' q or k projection in the GGUF's order: llama.cpp interleaves each head's two
    rotary halves, and transformers' GGUF loader undoes it (LlamaTensorProcessor._reverse_permute_weights)."""
    return np.arange(n).reshape(heads, n // heads // 2, 2).swapaxes(1, 2).reshape(n)


def gguf_linear_blocks(path: str | Path, model: nn.Module) -> dict[str, Blocks]:
    """The block-quantized weight of each Linear of a llama-family `model` (by module name) that the GGUF at `path`
    stores in Q4_1 or Q8_0 blocks, all of its parts alike, in the model's row order. Cached under the lmc cache dir
    (gguf-py's reader parses the file's whole vocabulary first: 2.4 s of the embedded model's start)."""
    from safetensors.torch import load_file, save_file

    from .loader import cache_dir, file_key

    cfg = model.cfg
    cache = (cache_dir() / "gguf_blocks" /
             f"{file_key(Path(path))}-{cfg.num_layers}-{cfg.num_heads}-{cfg.num_kv_heads}.safetensors")
    if cache.exists():
        flat = load_file(str(cache))
        return {name: Blocks(flat[f"{name}.codes"], flat[f"{name}.scales"], flat[f"{name}.mins"],
                             int(flat[f"{name}.bits"])) for name in {k.rsplit(".", 1)[0] for k in flat}}
    out = _read_linear_blocks(path, model)
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(f".{os.getpid()}.tmp")
    save_file({f"{name}.{field}": (torch.tensor(b.bits) if field == "bits" else getattr(b, field))
               for name, b in out.items() for field in ("codes", "scales", "mins", "bits")}, str(tmp))
    os.replace(tmp, cache)  # atomic: a concurrent start reads a whole file or none
    return out


def _read_linear_blocks(path: str | Path, model: nn.Module) -> dict[str, Blocks]:
    import gguf

    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    cfg = model.cfg

    def part(name: str, heads: int | None = None) -> Blocks | None:
        t = tensors.get(name)
        if t is None or int(t.tensor_type) not in _BITS:
            return None
        raw = np.asarray(t.data)
        if heads is not None:
            raw = raw[rope_row_order(raw.shape[0], heads)]
        return read_blocks(raw, int(t.tensor_type))

    heads = {"attn_q": cfg.num_heads, "attn_k": cfg.num_kv_heads}
    out: dict[str, Blocks] = {}
    for i in range(cfg.num_layers):
        for module, names in _LAYER_PARTS.items():
            parts = [part(f"blk.{i}.{g}.weight", heads.get(g)) for g in names]
            if all(p is not None for p in parts) and len({p.bits for p in parts}) == 1:
                out[f"layers.{i}.{module}"] = Blocks.cat(parts)
    head = part("output.weight") or (part("token_embd.weight") if cfg.tie_word_embeddings else None)
    if head is not None:
        out["lm_head"] = head
    return out


@torch.no_grad()
def checked_gguf_blocks(model: nn.Module, path: str | Path) -> dict[str, Blocks]:
    """The GGUF blocks of each Linear of `model` (not yet prepacked: its dense fp32 weight loaded) that dequantize
    to its weight exactly, by module name, for prepack_linears. A layer whose blocks differ (another file, a row
    order this module does not know) is left out, with a warning, and keeps fp32 panels."""
    linears = {name: m for name, m in model.named_modules()
               if isinstance(m, Linear) and m.weight is not None and m.weight.dtype == torch.float32}
    out = {}
    for name, blocks in gguf_linear_blocks(path, model).items():
        layer = linears.get(name)
        if layer is None:
            continue
        if blocks.codes.shape != layer.weight.shape or not torch.equal(blocks.dequantize(), layer.weight):
            log.warning("%s: the GGUF's blocks are not its loaded weight; it keeps fp32 panels", name)
            continue
        out[name] = blocks
    return out
