"""The model forward through torch.compile (inductor, dynamic shapes), with inductor's caches on disk under the lmc
cache dir (`$LMC_CACHE_DIR/inductor`): the first start compiles, later starts load the compiled graphs from its FX
graph cache and only re-trace with dynamo.

The KV write and attention run eagerly between the compiled pieces (llama.attend is excluded from graphs), so each
decoder layer compiles to fused elementwise kernels around its GEMMs (RMSNorm, rotary, SiLU-mul, residual adds).

Compilation failing (no C++ compiler, an unsupported op, a backend error) never fails a request: the forward warns
once and runs eagerly from then on.
"""
from __future__ import annotations

import os
import warnings

import torch


def enable_disk_cache() -> str:
    """Point inductor's caches (FX graph cache, autotuning, compiled kernels) into the lmc cache dir unless the
    user chose a place already (TORCHINDUCTOR_CACHE_DIR)."""
    from .model.loader import cache_dir

    path = os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))
    os.makedirs(path, exist_ok=True)
    return path


class CompiledForward:
    """Calls `model(input_ids, ctx)` through torch.compile; on any compilation error, warns and runs eagerly."""

    def __init__(self, model: torch.nn.Module):
        from .model import linear, llama

        self.model = model
        enable_disk_cache()
        linear.register_compile_op()
        if not hasattr(llama.attend, "_torchdynamo_disable"):  # once per process (llama.attend: why)
            llama.attend = torch.compiler.disable(llama.attend)
        # Sizes of 1 (batch-1 decode, one sampled row) would otherwise get graphs of their own, and so would each
        # layer for its `layer_id` (an int attribute, static by default): one graph must serve all layers.
        torch.fx.experimental._config.backed_size_oblivious = True
        torch._dynamo.config.allow_unspec_int_on_nn_module = True
        self.compiled = torch.compile(model, dynamic=True, fullgraph=False)
        self.failed: str | None = None

    def __call__(self, input_ids: torch.Tensor, ctx) -> torch.Tensor:
        if self.failed is None:
            try:
                return self.compiled(input_ids, ctx)
            except Exception as e:  # compile-time or backend failure: keep serving, eagerly
                self.failed = f"{type(e).__name__}: {e}"
                warnings.warn(f"torch.compile of the model failed ({self.failed[:500]}); running it eagerly",
                              RuntimeWarning, stacklevel=2)
        return self.model(input_ids, ctx)
