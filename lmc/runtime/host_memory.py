"""The host allocator for CPU inference: freed activations stay in the process for the next forward to reuse.

A CPU forward allocates and frees tensors of tens of MB in every layer (a 4,096-token prefill chunk: 50 MB for the
gate_up product's fp32 output). glibc's malloc serves every allocation above its mmap threshold (32 MB at the most)
with a fresh mmap and unmaps it at free, so each such tensor page-faults all of its memory in again, at a few GB/s:
the conversion of a [4096, 3072] bf16 output to fp32 took 15.8 ms into a fresh tensor and 1.7 ms into a reused one.
`keep_freed_memory()` turns glibc's mmap off for allocations (they come from the heap, whose freed blocks are reused)
and lets the heap shrink only past 2 GB of free top, what tcmalloc and jemalloc do by design (vLLM's CPU guide
preloads tcmalloc for this). On this machine's 2 cores, 48 unrelated 200-token prompts with 16 tokens generated
each took 6.1 s instead of 8.0 with the linears in bf16, whose casts allocate the most, and 12.6 s instead of 13.0
in fp32 (one engine each way, a probe; benchmarks/cpu_speed.py's no-sharing figure in results/cpu_speed_bf16.json
is recorded with it on).

Resident memory then stays at its peak instead of following the forward's allocations. Process-wide, and only for
glibc (Linux); elsewhere nothing changes.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)
TRIM_THRESHOLD = 2**31 - 1  # bytes of free heap top before the heap shrinks (mallopt takes an int)

_applied: list[bool] = []


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "mallopt") and hasattr(libc, "gnu_get_libc_version") else None
    except OSError:
        return None


def keep_freed_memory() -> bool:
    """Apply the settings of the module docstring once per process; whether glibc took them."""
    if not _applied:
        libc = _libc()
        _applied.append(libc is not None and bool(libc.mallopt(M_MMAP_MAX, 0))
                        and bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)))
    return _applied[0]
