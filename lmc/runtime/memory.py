"""KV memory in three layers (SGLang's design, page size 1):

1. The slot table: request row x position -> KV slot (an int32 table the attention kernels read); `RowAllocator`
   hands out its rows.
2. `SlotAllocator`: free list of token slots. Slot 0 is reserved as a dummy that padded or masked reads point at.
3. `KVCache`: per-layer K and V buffers of shape [num_slots + 1, kv_heads, head_dim].

All of this is index bookkeeping in torch; it runs the same on CPU and GPU.
"""
from __future__ import annotations

import numpy as np
import torch

DUMMY_ROW = 0  # the slot-table row that stays all zeros (see RowAllocator)


class RowAllocator:
    """Free list of slot-table rows 1..num_rows-1. Row 0 is the dummy row: it stays all zeros (the dummy slot 0),
    so CUDA-graph padding reads and writes only the dummy slot; it is never handed out. A resident request owns
    one row until it finishes, is retracted or is re-queued by a jump. Host-side only: the slot table itself lives
    twice, the scheduler's host copy (scheduler/cache.py) and the runner's device copy (runner.py)."""

    def __init__(self, num_rows: int):
        self.num_rows = num_rows
        self.reset()

    def reset(self) -> None:
        self._free = list(range(self.num_rows - 1, 0, -1))

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, row: int) -> None:
        self._free.append(row)

    @property
    def available(self) -> int:
        return len(self._free)


class SlotAllocator:
    """Free list of KV slots 1..num_slots (slot 0 is the dummy). Allocation and free are O(n) tensor ops.

    The free list lives on the CPU: the scheduler decides allocation on the host, and slot indices are copied to
    the device once per forward with the rest of the batch metadata.
    """

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free = torch.from_numpy(np.arange(1, num_slots + 1))  # numpy: no OpenMP region (runner.py)
        self._released: list[torch.Tensor] = []
        self._n_released = 0  # sum of len(t) over _released: admission asks `available` per waiting request

    @property
    def available(self) -> int:
        return len(self._free) + self._n_released

    def alloc(self, n: int) -> torch.Tensor | None:
        if n > len(self._free) and self._released:
            self._free = torch.cat([self._free, *self._released])
            self._released, self._n_released = [], 0
        if n > len(self._free):
            return None
        out, self._free = self._free[:n], self._free[n:]
        return out

    def free(self, slots: torch.Tensor) -> None:
        if len(slots):
            self._released.append(slots.to("cpu", torch.int64))
            self._n_released += len(slots)

    def free_slots(self) -> torch.Tensor:
        return torch.cat([self._free, *self._released])


class KVCache:
    """Per-layer K/V buffers indexed by slot."""

    def __init__(self, num_layers: int, num_slots: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device):
        shape = (num_slots + 1, kv_heads, head_dim)
        # Uninitialised (zero-filling gigabytes costs seconds at start-up): a slot is always written before it is
        # read, except the dummy slot 0 that padding reads, which must hold finite values.
        self.k = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.empty(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        for buf in self.k + self.v:
            buf[0].zero_()

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer][slots] = k
        self.v[layer][slots] = v

    @staticmethod
    def bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()
