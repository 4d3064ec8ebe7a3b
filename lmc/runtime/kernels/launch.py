"""What the forward's Triton kernels share at launch: programmatic dependent launch (PDL) on Hopper, and the
zeroed int32 counters that a kernel's programs count themselves in (split-K GEMM tiles, decode splits).

PDL: a kernel launched with `launch_pdl` may start while the kernel before it in the stream still runs; it must
execute `griddepcontrol.wait` (gdc_wait) before it touches anything that kernel writes or reads. Every kernel here
calls `grid_dependency` first thing, before any load or store of activations and before any early return: an early
return before the wait would let the kernel after it start before the one before it finished, since the wait is
what orders them transitively. The call also signals the next kernel that it may launch (its programs then wait at
their own gdc_wait). What a kernel reads that no kernel writes (weights) it may fetch before the wait: the skinny
GEMM prefetches the first of its weight tiles into L2 there, so a decode step's weight stream starts while the
small kernels before each GEMM (norm, rotary, attention, SiLU-mul) leave the memory bus idle. Kernels launched
without PDL (cuBLAS, torch's) order as usual; a PDL kernel after one waits for it at its gdc_wait.

Off the GPU (the interpreter) and before Hopper, PDL is off: the flag is a constexpr, so its branch compiles away.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# LMC_PDL=0 turns PDL off (an A/B switch: benchmarks/gpu_step_ab.py); read at each launch, so graphs captured
# after a change take the new value.
ENABLED = os.environ.get("LMC_PDL", "1") != "0"

_hopper: dict[int, bool] = {}


def pdl(x: torch.Tensor) -> bool:
    """Whether kernels over x (a CUDA tensor, else False) launch with PDL: sm_90 and later, ENABLED."""
    if not (ENABLED and x.is_cuda):
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


@triton.jit
def prefetch_l2(ptrs):
    """Fetch the 128-byte lines at `ptrs` into L2 (no registers written, no fault past an allocation's end is
    relied on: callers clamp their pointers in bounds). GPU only (inline PTX)."""
    tl.inline_asm_elementwise("mov.u32 $0, 0;\n\tprefetch.global.L2 [$1];", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


_counters: dict[torch.device, torch.Tensor] = {}


def counters(device: torch.device, n: int) -> torch.Tensor:
    """At least n int32 zeros on `device`, shared by every kernel that counts its programs: each such kernel sets
    the counters it used back to 0 before it ends, and kernels run in stream order, so one buffer serves all.
    Allocated (or grown) on first use, which is a warm-up forward before any CUDA-graph capture
    (cuda_graph.DecodeGraphs), so captured graphs and later launches share it."""
    c = _counters.get(device)
    if c is None or c.numel() < n:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("kernel counters must be allocated by a warm-up run before a CUDA-graph capture")
        c = _counters[device] = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
    return c
