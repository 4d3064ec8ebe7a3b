"""The model's linear layers: `y = x W^T (+ b)`, with the weight prepacked for oneDNN on the CPU.

A decode step on the CPU is bound by reading the weights (fp32 SmolLM2-135M: 540 MB a step), and a plain
`F.linear` hands MKL a row-major weight that it re-blocks on every call. `prepack_linears(model)` reorders each
fp32 CPU weight once into oneDNN's blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, the layout that
inductor's freezing pass and vLLM's CPU backend use) and drops the dense copy; forwards then run
`torch.ops.mkldnn._linear_pointwise` on it, which serves any batch size (the batch hint only tunes the layout).
MKL's own packed GEMM (`torch.ops.mkl._mkl_linear`) is not used: it takes its packed path only at the exact
batch size it was packed for and runs an unpacked GEMM otherwise.

Before prepacking (loading, sharding, dummy fill, GPU, other dtypes) a Linear is an ordinary module with a
`weight` parameter [out_features, in_features] and an optional `bias` [out_features], named as nn.Linear's.
"""
from __future__ import annotations

import torch
from torch import nn

from .. import kernels

# The batch size oneDNN's weight layout is chosen for: a decode batch. Measured on this build (2 cores, AVX-512):
# the same blocked layout serves batches 1-1024 within noise of a layout packed for each.
PACK_BATCH_HINT = 16


def prepack_supported(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available())


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.packed: torch.Tensor | None = None  # oneDNN-blocked weight once prepack() ran; then `weight` is None

    @torch.no_grad()
    def prepack(self) -> bool:
        """Reorder the weight into oneDNN's layout and drop the dense copy. Returns whether it did (CPU fp32
        with oneDNN only; elsewhere the layer stays on F.linear)."""
        if self.packed is not None:
            return True
        if not prepack_supported(self.weight):
            return False
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), PACK_BATCH_HINT)
        self.weight = None  # a tied weight stays alive through its other owner (the embedding)
        return True

    @torch.no_grad()
    def set_weight(self, weight: torch.Tensor) -> None:
        """New values for the weight [out_features, in_features], packed again if the layer was prepacked."""
        if self.packed is None:
            self.weight.copy_(weight)
        else:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.float().contiguous(), PACK_BATCH_HINT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return kernels.linear(x, self.weight, self.bias)  # F.linear, or a faster decode GEMM on the GPU
        if torch.compiler.is_compiling():  # inductor cannot lower mkldnn's op on an opaque tensor: hide it
            return _compile_op(x, self.packed, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"prepacked={self.packed is not None}")


def prepack_linears(model: nn.Module) -> int:
    """Prepack every Linear of `model` that can be (see Linear.prepack); returns how many were."""
    return sum(m.prepack() for m in model.modules() if isinstance(m, Linear))


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
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    @packed_linear.register_fake
    def _(x, packed, bias):
        return x.new_empty(*x.shape[:-1], packed.shape[0])

    _compile_op = packed_linear
