"""Programmatic dependent launch (PDL) on Hopper for the forward's Triton kernels.

PDL: a kernel launched with `launch_pdl` may start while the kernel before it in the stream still runs; it must
execute `griddepcontrol.wait` (gdc_wait) before it touches anything that kernel writes or reads. Every kernel here
calls `grid_dependency` first thing, before any load or store of activations and before any early return: an early
return before the wait would let the kernel after it start before the one before it finished, since the wait is
what orders them transitively. The call also signals the next kernel that it may launch (its programs then wait at
their own gdc_wait), so the next kernel's launch and start overlap this one's run. On the H200 a decode step's CUDA
graph replayed in 3.89 ms against 4.05 without PDL (llama-2-7b, batch 1), 4.39 against 4.46 (batch 8), 4.33
against 4.43 (batch 1 at 3,000 tokens), 4.44 against 4.55 (llama-3-8b, batch 1); batch 64, whose GEMMs are
cuBLAS's, is unchanged (benchmarks/gpu_step_ab.py, results/h200_probe/step_ab2.json). Tried and dropped
(results/h200_probe/step_ab.json): the skinny GEMM prefetching its first 512 or 1024 weight columns into L2 before
its wait (4.07 / 4.20 ms against 3.98), and split decode merged in stage 1 by its last split instead of a stage-2
launch (llama-3-8b batch 1: 4.68 against 4.56 ms, its four heads' merges serialized in one program).
Kernels launched without PDL (cuBLAS, torch's) order as usual; a PDL kernel after one waits for it at its gdc_wait.

Off the GPU (the interpreter) and before Hopper, PDL is off: the flag is a constexpr, so its branch compiles away.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Where kernels launch with PDL: "on" (everywhere), "graphs" (only inside a CUDA-graph capture: the decode step),
# "off". LMC_PDL sets it (an A/B switch: benchmarks/gpu_step_ab.py); read at each launch, so graphs captured after
# a change take the new value.
MODE = os.environ.get("LMC_PDL", "on")

_hopper: dict[int, bool] = {}


def pdl(x: torch.Tensor) -> bool:
    """Whether a kernel over x (a CUDA tensor, else False) launches with PDL now: sm_90 and later, as MODE says."""
    if MODE == "off" or not x.is_cuda or (MODE == "graphs" and not torch.cuda.is_current_stream_capturing()):
        return False
    idx = x.device.index if x.device.index is not None else torch.cuda.current_device()
    if idx not in _hopper:
        _hopper[idx] = torch.cuda.get_device_capability(idx) >= (9, 0)
    return _hopper[idx]


def pdl_args(x: torch.Tensor) -> dict:
    """The launch arguments of a kernel with a PDL constexpr, over x: the constexpr, and Triton's launch option."""
    return {"PDL": True, "launch_pdl": True} if pdl(x) else {"PDL": False}


@triton.jit
def grid_dependency(PDL: tl.constexpr):
    """Wait for the kernel before this one (all its writes visible), then let the next one launch."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
