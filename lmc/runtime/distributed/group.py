"""The ranks' process groups (torch.distributed): one for the forward's collectives, NCCL on CUDA and gloo on the
CPU, and a gloo control group on which workers wait for the next step.

The control group has a long timeout: a worker waits on it for as long as the engine idles, and a wait on an
NCCL group would be failed by its watchdog after the NCCL timeout. A dead peer is noticed by gloo at once (its
sockets close), not after the timeout.

The groups are the process's default torch.distributed world, so a process holds one tensor-parallel engine at
a time (`init` says so if another one is running).
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from .plan import TensorParallelError

# A forward's collectives finish in well under this; a rank stuck longer than it is treated as failed.
COLLECTIVE_TIMEOUT = timedelta(minutes=10)
IDLE_TIMEOUT = timedelta(days=365)  # the control group: workers wait on it between steps


class Comm:
    """The collectives one rank runs in the forward, over the data group."""

    def __init__(self, rank: int, world: int, device: torch.device, control):
        self.rank, self.world, self.device, self.control = rank, world, device, control

    @torch.compiler.disable
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t)
        return t

    @torch.compiler.disable
    def all_gather_columns(self, t: torch.Tensor) -> torch.Tensor:
        """[K, n] on every rank -> [K, world * n], rank r's columns at [r * n, (r + 1) * n)."""
        out = torch.empty((self.world * t.shape[0], t.shape[1]), dtype=t.dtype, device=t.device)
        _all_gather_single(out, t.contiguous())
        return out.view(self.world, t.shape[0], t.shape[1]).permute(1, 0, 2).reshape(t.shape[0], -1)

    def min_int(self, value: int) -> int:
        """The smallest of every rank's `value` (ranks agree on the KV pool's size)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control)
        return int(t.item())


# torch 2.13 renamed all_gather_into_tensor (the old name warns); older releases have only the old one.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def init(store, rank: int, world: int, device: torch.device) -> Comm:
    """Join the ranks' groups through `store` (a torch.distributed TCPStore that rank 0 serves)."""
    if dist.is_initialized():
        raise TensorParallelError("this process already runs a tensor-parallel engine (torch.distributed is "
                                  "initialized): shut it down before starting another")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend_for(device), store=store, rank=rank, world_size=world,
                            timeout=COLLECTIVE_TIMEOUT, device_id=device if device.type == "cuda" else None)
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    return Comm(rank, world, device, control)


def destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
