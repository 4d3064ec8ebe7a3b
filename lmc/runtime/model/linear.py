"""The model's linear layers: `y = x W^T (+ b)`, with the weight prepacked on the CPU.

A decode step on the CPU is bound by reading the weights (fp32 SmolLM2-135M: 540 MB a step), and a plain
`F.linear` hands MKL a row-major weight that it re-blocks on every call. `prepack_linears(model)` reorders each
fp32 CPU weight once, into one of two layouts:
- panels (AVX-512 and AVX2 CPUs, where the C++ library of attention/cpu_kernel.py has `panel_linear`): [N / P, K, P]
  with P = 48 (AVX-512) or 16 (AVX2),
  run by that library's GEMM, which streams the weight from memory once per call. At decode batch sizes oneDNN's
  and MKL's kernels take two to five times its time on this machine (2 cores, AVX-512: benchmarks/cpu_speed.py
  --gemm). From LARGE_ROWS rows of x on (prefill chunks) oneDNN's GEMM is faster, so its packed weight is kept
  beside the panels, and the dense copy is dropped. The panels may instead hold a GGUF's Q4_1 / Q8_0 blocks
  (`prepack(blocks=...)`, gguf_blocks.py), with the same results.
- oneDNN's blocked layout elsewhere (`torch.ops.mkldnn._reorder_linear_weight`, the layout that inductor's
  freezing pass and vLLM's CPU backend use), run by `torch.ops.mkldnn._linear_pointwise`; it serves any batch size
  (the batch hint only tunes the layout). MKL's own packed GEMM (`torch.ops.mkl._mkl_linear`) is not used: it
  takes its packed path only at the exact batch size it was packed for and runs an unpacked GEMM otherwise.

With `matmul_dtype=torch.bfloat16` (`Engine(dtype="bfloat16")` on the CPU) the weight is packed in bf16 for oneDNN
instead, which runs it on AMX tiles or AVX-512 BF16 (`bf16_supported`): x is rounded to bf16 on the way in, y comes
out of oneDNN in bf16 (fp32 accumulation) and stays bf16 (with a bias: widened to fp32, the bias added in fp32). The
model around the linears (norms, rotary, attention, the KV cache) computes in fp32, as torch.autocast runs a model
in bf16 on the CPU; the C++ kernels read the bf16 outputs and the norms and SiLU-mul write the next linear's input
in bf16 (attention/cpu_kernel.py), so a prefill makes no fp32 copies of its bf16 activations. Where the panel GEMM
is built, the weight is also packed in bf16 panels (the C++ kernel widens each bf16 weight to fp32 with a shift, so
a decode step streams half the bytes: 12.1 against 19.6 ms of a step's linears at one row), which serve below
BF16_LARGE_ROWS rows, y rounded to bf16 but kept in fp32 (a decode step's activations are small); oneDNN's bf16
GEMM serves more (AMX: 29.9 against the fp32 panels' 74.0 ms at 64 rows). Figures: benchmarks/cpu_speed.py --gemm
on this machine's 2 cores (Xeon with AMX), results/cpu_speed_bf16.json.

Before prepacking (loading, sharding, dummy fill, GPU, other dtypes) a Linear is an ordinary module with a
`weight` parameter [out_features, in_features] and an optional `bias` [out_features], named as nn.Linear's.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels

# Rows of x from which the panels' layer runs oneDNN's fp32 GEMM on its packed weight instead. A step's linears at
# 30 layers' distinct weights (benchmarks/cpu_speed.py --gemm), panels / oneDNN / MKL on the dense weight, ms: 2-core
# AMD EPYC (AVX-512) 38 / 36 / 82 at 64 rows, 136 / 113 / 290 at 256, 553 / 449 / 1030 at 1024, 1046 / 879 / 1984 at
# 2048 (MKL's sgemm takes a generic path on a non-Intel CPU); 2-core Xeon 252 / 203 / 231 at 256, 1110 / 1042 / 926 at
# 1024. Below 64 rows the panels win by two to five times.
LARGE_ROWS = 256
# Rows of x from which bf16 panels hand the product to oneDNN's bf16 GEMM (AMX): below it the panels stream the bf16
# weight at memory speed, from it AMX's tiles win (benchmarks/cpu_speed.py --gemm, its bf16_panels and bf16_onednn
# columns: 15.2 against 22.1 ms of a step's linears at 8 rows, 26.4 against 22.6 at 16, 50.3 against 32.0 at 32).
BF16_LARGE_ROWS = 16
# The batch size oneDNN's weight layout is chosen for: a decode batch. Measured on this build (2 cores, AVX-512):
# the same blocked layout serves batches 1-1024 within noise of a layout packed for each.
PACK_BATCH_HINT = 16


def prepack_supported(weight: torch.Tensor, matmul_dtype: torch.dtype = torch.float32) -> bool:
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return False
    if matmul_dtype == torch.bfloat16:
        return bf16_supported()
    return matmul_dtype == torch.float32 and (torch.backends.mkldnn.is_available() or _panel_ops() is not None)


def bf16_supported() -> bool:
    """Whether oneDNN runs bf16 linears on this CPU natively (AVX-512 BF16 or AMX), where packing in bf16 pays."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _panel_ops():
    """The C++ library with the panel GEMM, or None (neither AVX-512 nor AVX2, no toolchain)."""
    from ..attention.cpu_kernel import panels

    return panels()


def _onednn_pack(weight: torch.Tensor, matmul_dtype: torch.dtype) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(matmul_dtype).contiguous(), PACK_BATCH_HINT)


def _onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's linear on a packed weight. A bf16 weight takes x rounded to bf16 and gives y in bf16, or with a
    bias, y widened to fp32 with the bias added in fp32 (module docstring)."""
    if packed.dtype == x.dtype and (bias is None or bias.dtype == x.dtype):
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    y = torch.ops.mkldnn._linear_pointwise(x.to(packed.dtype), packed, None, "none", [], "")
    return y if bias is None else y.to(bias.dtype) + bias


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.packed: torch.Tensor | None = None  # the packed weight once prepack() ran
        self.panels = False  # whether `packed` is in panels (else oneDNN's layout, and `weight` is None)
        self.matmul_dtype = torch.float32  # the packed weight's dtype (prepack's argument)
        self.large: torch.Tensor | None = None  # panels: oneDNN's packed weight, for rows from (BF16_)LARGE_ROWS on
        self.block_bits = 0  # 4 or 8: `packed` holds a GGUF's Q4_1 or Q8_0 blocks in panels (prepack's blocks)

    @torch.no_grad()
    def prepack(self, matmul_dtype: torch.dtype = torch.float32, blocks=None) -> bool:
        """Pack the weight (panels or oneDNN's layout, in `matmul_dtype`: see the module docstring) and drop the
        dense copy where oneDNN's packed weight serves large inputs. `blocks` (gguf_blocks.Blocks, fp32 panels only):
        the weight's GGUF blocks, which dequantize to it exactly (gguf_blocks.checked_gguf_blocks checks), packed
        in place of the fp32 panels: the same outputs, from 0.625 or 1.0625 bytes a weight instead of 4. Returns
        whether it packed (an fp32 CPU weight only; elsewhere the layer stays on F.linear)."""
        if self.packed is not None:
            return True
        if not prepack_supported(self.weight, matmul_dtype):
            return False
        self.matmul_dtype = matmul_dtype
        self._pack(self.weight, blocks)
        if not self.panels or self.large is not None:
            self.weight = None  # a tied weight stays alive through its other owner (the embedding)
        return True

    def _pack(self, weight: torch.Tensor, blocks=None) -> None:
        """`packed` (and `large`) from `weight` (or its `blocks`) in `matmul_dtype`: panels where the library has
        them, else oneDNN's layout."""
        ops = _panel_ops()
        self.panels = ops is not None
        self.block_bits = 0
        if ops is None:
            self.packed = _onednn_pack(weight, self.matmul_dtype)
            return
        if blocks is not None and self.matmul_dtype == torch.float32:
            self.packed = ops.pack_block_panels(blocks.codes, blocks.scales, blocks.mins, blocks.bits)
            self.block_bits = blocks.bits
        else:
            self.packed = ops.pack_panels(weight.detach().to(self.matmul_dtype).contiguous())
        self.large = _onednn_pack(weight, self.matmul_dtype) if torch.backends.mkldnn.is_available() else None

    @torch.no_grad()
    def set_weight(self, weight: torch.Tensor) -> None:
        """New values for the weight [out_features, in_features], packed again if the layer was prepacked (in
        panels of its dtype: GGUF blocks, which would no longer hold it, are dropped)."""
        if self.weight is not None:
            self.weight.copy_(weight)
        if self.packed is not None:
            self._pack(weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return kernels.linear(x, self.weight, self.bias)  # F.linear, or a faster decode GEMM on the GPU
        if self.panels:  # an op with a fake implementation (cpu_kernel.py): torch.compile keeps it opaque
            rows = x.reshape(-1, self.in_features).contiguous()
            # (not while compiling: a branch on the batch size would be a guard, and a recompile mid-serving; and
            # is_compiling first: dynamo cannot fake oneDNN's opaque tensor, so a compiled forward never touches it)
            if not torch.compiler.is_compiling() and self.large is not None and rows.shape[0] >= (
                    LARGE_ROWS if self.matmul_dtype == torch.float32 else BF16_LARGE_ROWS):
                # oneDNN (bf16: its bf16 output is what the bf16 panels round to), so y is the same whichever path
                # a row count takes, up to the summation order
                return _onednn_linear(x, self.large, self.bias)
            ops, n = torch.ops.lmc_cpu, self.out_features
            y = (ops.block_panel_linear(rows, self.packed, n, self.block_bits, self.bias) if self.block_bits
                 else ops.panel_linear(rows, self.packed, n, self.bias))
            return y.view(*x.shape[:-1], self.out_features)
        if torch.compiler.is_compiling():  # inductor cannot lower mkldnn's op on an opaque tensor: hide it
            return _compile_op(x, self.packed, self.bias)
        return _onednn_linear(x, self.packed, self.bias)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """kernels.silu_mul(self(x)) for a gate_up layer (gate rows, then up rows): one kernel where the GPU's
        decode GEMM serves the product (kernels.linear_silu_mul)."""
        if self.packed is None and self.bias is None:
            return kernels.linear_silu_mul(x, self.weight)
        return kernels.silu_mul(self(x))

    def rope_q_write_kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_q_heads: int,
                        num_kv_heads: int, head_dim: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        slots: torch.Tensor) -> torch.Tensor:
        """kernels.rope_q_write_kv(self(x), ...) for a QKV layer: one kernel where the GPU's decode GEMM serves the
        product (kernels.linear_rope_q_write_kv). Returns q."""
        args = (cos, sin, num_q_heads, num_kv_heads, head_dim, k_cache, v_cache, slots)
        if self.packed is None and self.bias is None:
            return kernels.linear_rope_q_write_kv(x, self.weight, *args)
        return kernels.rope_q_write_kv(self(x), *args)

    def extra_repr(self) -> str:
        packed = (f"q{self.block_bits} blocks" if self.block_bits else "panels" if self.panels
                  else self.packed is not None and str(self.matmul_dtype).split(".")[-1])
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"prepacked={packed}")


def prepack_linears(model: nn.Module, matmul_dtype: torch.dtype = torch.float32, blocks: dict | None = None) -> int:
    """Prepack every Linear of `model` that can be, in `matmul_dtype`, each from its GGUF blocks in `blocks` (by
    module name) where given (see Linear.prepack); returns how many were."""
    blocks = blocks or {}
    return sum(m.prepack(matmul_dtype, blocks.get(name)) for name, m in model.named_modules() if isinstance(m, Linear))


_compile_op = None  # lmc::packed_linear, defined by register_compile_op()


def register_compile_op() -> None:
    """Define `lmc::packed_linear`, the prepacked linear as a custom op that torch.compile keeps opaque (its
    fake implementation gives the output's shape). Called by compiled.py before tracing; not at import, since
    defining an op imports dynamo (seconds of every start)."""
    global _compile_op
    if _compile_op is not None:
        return

    @torch.library.custom_op("lmc::packed_linear", mutates_args=())
    def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return _onednn_linear(x, packed, bias)

    @packed_linear.register_fake
    def _(x, packed, bias):
        return x.new_empty(*x.shape[:-1], packed.shape[0])

    _compile_op = packed_linear
