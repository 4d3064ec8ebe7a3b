"""host_memory.keep_freed_memory: on glibc, large tensors come from the heap and their memory is reused."""
import ctypes
import sys

import pytest
import torch

from lmc.runtime import host_memory


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


@pytest.mark.skipif(not sys.platform.startswith("linux") or host_memory._libc() is None, reason="not glibc")
def test_large_tensors_come_from_the_heap_after_it():
    libc = host_memory._libc()
    if not hasattr(libc, "mallinfo2"):
        pytest.skip("glibc before 2.33 (no mallinfo2)")
    libc.mallinfo2.restype = _MallInfo2
    assert host_memory.keep_freed_memory() and host_memory.keep_freed_memory()  # once, then remembered
    mmapped = libc.mallinfo2().hblkhd
    t = torch.empty(64 * 2**20, dtype=torch.uint8)  # 64 MB: above any mmap threshold glibc would pick itself
    t.fill_(1)
    assert libc.mallinfo2().hblkhd - mmapped < 2**20  # not a new mmap: the heap served it
    heap = libc.mallinfo2().arena
    del t
    assert libc.mallinfo2().arena >= heap - 2**20  # freed into the heap, not trimmed away: the next one reuses it
