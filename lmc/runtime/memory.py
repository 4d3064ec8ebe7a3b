"""KV memory in three layers (SGLang's design, page size 1):

1. `ReqToTokenPool`: request row x position -> KV slot (an int32 table the attention kernels read).
2. `SlotAllocator`: free list of token slots. Slot 0 is reserved as a dummy that padded or masked reads point at.
3. `KVCache`: per-layer K and V buffers of shape [num_slots + 1, kv_heads, head_dim].

All of this is index bookkeeping in torch; it runs the same on CPU and GPU.
"""
from __future__ import annotations

import torch


class ReqToTokenPool:
    """Rows of the slot table. A resident request owns one row until it finishes or is retracted."""

    def __init__(self, num_rows: int, max_context: int, device: torch.device):
        self.table = torch.zeros((num_rows, max_context), dtype=torch.int32, device=device)
        self.max_context = max_context
        self.reset()

    def reset(self) -> None:
        self._free = list(range(len(self.table) - 1, -1, -1))

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
        self._free = torch.arange(1, num_slots + 1, dtype=torch.int64)
        self._released: list[torch.Tensor] = []

    @property
    def available(self) -> int:
        return len(self._free) + sum(len(t) for t in self._released)

    def alloc(self, n: int) -> torch.Tensor | None:
        if n > len(self._free) and self._released:
            self._free = torch.cat([self._free, *self._released])
            self._released = []
        if n > len(self._free):
            return None
        out, self._free = self._free[:n], self._free[n:]
        return out

    def free(self, slots: torch.Tensor) -> None:
        if len(slots):
            self._released.append(slots.to("cpu", torch.int64))

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
