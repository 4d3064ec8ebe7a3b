"""One scheduler, N ranks: rank 0 is the engine's own ModelRunner; ranks 1..N-1 are worker processes
(torch.multiprocessing, spawn), each holding its shard of the weights and of the KV cache.

Each forward, rank 0 broadcasts the step as ModelRunner.launch packed it (one int64 tensor, its parts' sizes and
the step's shape) before running it; every worker runs the same forward on it (`ModelRunner._forward`, which also
writes the step's slots into the rank's own slot table), so the ranks' collectives pair up. Only rank 0 samples:
the logits are gathered to every rank (one all-gather, which CUDA graphs capture), the workers drop theirs; a step
that reads sampled ids from the token buffer broadcasts rank 0's buffer first (`RankShard.share_tokens`).

Failure: a worker that dies (or any error once a step is under way: the ranks' collectives no longer pair up)
fails the whole group. A watcher thread notices a worker's exit even while the engine idles and stops the other
workers at once; the step that is running, and every later one, raises TensorParallelFailure, so every pending
request fails with an error naming the dead worker, and no process is left behind. Workers exit on their own
when rank 0's process dies (its sockets close, or they see their parent gone).
"""
from __future__ import annotations

import logging
import os
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import wait

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ..core import EngineError
from . import group
from .layers import ShardSelector, fill_dummy_sharded, shard_model
from .plan import ShardPlan, TensorParallelError, local_config, plan_shards

log = logging.getLogger(__name__)

_STEP, _STOP = 1, 0
_SHAPE, _PARTS = 5, 15  # ModelRunner.launch's step shape and number of packed parts
_HEADER = 1 + _SHAPE + _PARTS  # the command, the shape, the parts' sizes
_START_TIMEOUT_S = 600.0


class TensorParallelFailure(EngineError):
    """The tensor-parallel group failed (a worker died, or a step broke off half-way): the engine cannot run
    forwards any more and must be restarted."""


class RankShard:
    """What a ModelRunner needs to build and run one rank's shard of the model."""

    def __init__(self, plan: ShardPlan, comm: group.Comm):
        self.plan, self.comm = plan, comm

    @property
    def failure(self) -> str | None:
        return None

    def local_config(self, cfg):
        return local_config(cfg, self.plan)

    def shard(self, model, vocab_size: int) -> None:
        shard_model(model, self.plan, vocab_size, self.comm)

    def selector(self, head_dim: int) -> ShardSelector:
        return ShardSelector(self.plan, head_dim)

    def fill_dummy(self, model, cfg, seed: int) -> None:
        from ..model.llama import LlamaForCausalLM

        with torch.device("meta"):
            whole = LlamaForCausalLM(cfg)
        fill_dummy_sharded(model, whole, self.selector(cfg.head_dim), seed)

    def share_tokens(self, token_buf: torch.Tensor) -> None:
        """Rank 0's token buffer (the ids it sampled) into every rank's, on the forward's group."""
        dist.broadcast(token_buf, 0)

    def agree_min(self, value: int) -> int:
        return self.comm.min_int(value)

    def close(self) -> None:
        """A worker's groups are torn down by its main loop."""


@dataclass
class _Worker:
    rank: int
    process: object
    errors: object  # the parent's end of a pipe the worker sends its start-up / crash traceback through
    report: str | None = None

    def describe(self) -> str:
        if self.errors.poll():
            try:
                _, self.report = self.errors.recv()
            except (EOFError, OSError):
                pass
        self.process.join(2.0)  # its sentinel fires as it exits, a moment before it can be reaped
        code = self.process.exitcode
        how = (f"was killed by signal {-code}" if code is not None and code < 0 else
               f"exited with code {code}" if code is not None else "stopped answering")
        tail = f": {self.report.strip().splitlines()[-1]}" if self.report else ""
        return f"tensor-parallel worker rank {self.rank} (pid {self.process.pid}) {how}{tail}"


class TensorParallel(RankShard):
    """Rank 0: the engine's side of the group. Spawns and watches the workers, broadcasts every step to them."""

    def __init__(self, plan: ShardPlan, comm: group.Comm, workers: list[_Worker]):
        super().__init__(plan, comm)
        self.workers = workers
        self._failure: str | None = None
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._torn_down = False
        self._watcher = threading.Thread(target=self._watch, name="lmc-tp-watch", daemon=True)
        self._watcher.start()

    @property
    def failure(self) -> str | None:
        return self._failure

    def run_step(self, forward, host: torch.Tensor, sizes: list[int], shape: tuple):
        """Broadcast the packed step to the workers, then run rank 0's `forward` of it."""
        if self._failure is not None:
            raise TensorParallelFailure(self._failure)
        try:
            _send_step(host, sizes, shape, self.comm)
            return forward(host, sizes, shape)
        except Exception as e:
            self._fail(f"a tensor-parallel step broke off: {type(e).__name__}: {e}", wait_for_watcher=True)
            raise TensorParallelFailure(self._failure) from e

    # ---- failure and shutdown -------------------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._closed.is_set():
            dead = [w for w in self.workers if w.process.sentinel in wait([w.process.sentinel
                                                                              for w in self.workers], timeout=0.5)]
            if dead and not self._closed.is_set():
                self._fail("; ".join(w.describe() for w in dead))
                return

    def _fail(self, reason: str, wait_for_watcher: bool = False) -> None:
        """Record the first failure (a dead worker's description wins over the broken collective it caused) and
        stop every worker."""
        if wait_for_watcher:  # the collective may have failed a moment before the watcher saw the exit
            deadline = time.monotonic() + 2.0
            while self._failure is None and time.monotonic() < deadline and self._watcher.is_alive():
                time.sleep(0.05)
        with self._lock:
            if self._failure is None:
                self._failure = reason
                log.error("tensor parallelism failed: %s; stopping the workers", reason)
        self._abort_collectives()
        self._kill_workers()

    def _abort_collectives(self) -> None:
        """Unblock rank 0 if it waits in an NCCL collective on a dead peer (gloo notices the closed sockets)."""
        if self.comm.device.type == "cuda" and dist.is_initialized():
            abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
            if abort is not None:
                try:
                    abort()
                except Exception as e:  # best effort: the workers are killed next anyway
                    log.warning("aborting the NCCL group failed: %s", e)

    def _kill_workers(self, grace_s: float = 0.0) -> None:
        for w in self.workers:
            w.process.join(grace_s)
            if w.process.is_alive():
                w.process.kill()
        for w in self.workers:
            w.process.join(10.0)

    def close(self) -> None:
        """Stop the workers (a stop command, then a kill for any that do not exit) and leave the groups.
        Idempotent; safe after a failure."""
        with self._lock:
            if self._torn_down:
                return
            self._torn_down = True
        self._closed.set()
        if self._failure is None:
            try:
                dist.broadcast(torch.tensor([_STOP] + [0] * (_HEADER - 1), dtype=torch.int64), 0,
                               group=self.comm.control)
            except Exception as e:
                log.warning("telling the tensor-parallel workers to stop failed: %s", e)
        self._kill_workers(grace_s=30.0)
        self._watcher.join()
        try:
            group.destroy()
        except Exception as e:  # the group of a failed engine may refuse a clean exit
            log.warning("leaving the tensor-parallel group failed: %s", e)


# ---- the step on the wire -----------------------------------------------------------------------------------
def _send_step(host: torch.Tensor, sizes: list[int], shape: tuple, comm: group.Comm) -> None:
    assert len(shape) == _SHAPE and len(sizes) == _PARTS, "ModelRunner.launch's packing changed: update _SHAPE, _PARTS"
    header = torch.tensor([_STEP, *map(int, shape), *sizes], dtype=torch.int64)
    dist.broadcast(header, 0, group=comm.control)
    dist.broadcast(host, 0, group=comm.control)


def _recv_step(comm: group.Comm, header: list[int]) -> tuple[torch.Tensor, list[int], tuple]:
    shape, sizes = header[1:1 + _SHAPE], header[1 + _SHAPE:]
    host = torch.empty(sum(sizes), dtype=torch.int64)
    dist.broadcast(host, 0, group=comm.control)
    return host, sizes, (bool(shape[0]), *shape[1:])


# ---- starting the group -------------------------------------------------------------------------------------
@dataclass
class _WorkerSpec:
    rank: int
    world: int
    port: int
    device: str
    model: str
    num_threads: int
    runner_kwargs: dict = field(default_factory=dict)


def rank_devices(device: torch.device, world: int) -> list[torch.device]:
    """Rank r's device: the CPU for every rank, or the r-th GPU from the engine's."""
    if device.type != "cuda":
        return [device] * world
    base = device.index or 0
    have = torch.cuda.device_count()
    if base + world > have:
        raise TensorParallelError(f"tensor_parallel_size {world} needs {world} GPUs from cuda:{base}, but "
                                  f"{have} GPU(s) are present")
    return [torch.device("cuda", base + r) for r in range(world)]


def start_runner(src, world: int, *, device: torch.device, **runner_kwargs):
    """Spawn the workers and build rank 0's ModelRunner over `src` (a loader.ModelSource) on `device`;
    TensorParallelError for a size the model or the machine cannot take, TensorParallelFailure if a worker
    fails to start. Everything started is stopped again on failure."""
    from ..model.llama import ModelConfig
    from ..runner import ModelRunner

    plans = plan_shards(ModelConfig.from_hf(src.hf_config), world)
    devices = rank_devices(device, world)
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, timeout=timedelta(seconds=_START_TIMEOUT_S),
                          wait_for_workers=False)
    ctx = mp.get_context("spawn")
    workers: list[_Worker] = []
    tp = None
    try:
        threads = max(1, torch.get_num_threads() // world)
        for r in range(1, world):
            parent, child = ctx.Pipe(duplex=False)
            spec = _WorkerSpec(r, world, store.port, str(devices[r]), src.name, threads, runner_kwargs)
            proc = ctx.Process(target=_worker_main, args=(spec, child), name=f"lmc-tp-rank{r}", daemon=True)
            proc.start()
            child.close()
            workers.append(_Worker(r, proc, parent))
        _wait_ready(workers)
        tp = TensorParallel(plans[0], group.init(store, 0, world, devices[0]), workers)
        return ModelRunner(src.hf_config, src.weight_slices, device=devices[0], tp=tp, **runner_kwargs)
    except BaseException as e:
        dead = [w.describe() for w in workers if not w.process.is_alive()]
        if tp is not None:
            tp._fail("the engine failed to start")
            tp.close()
        else:
            for w in workers:
                w.process.kill()
                w.process.join(10.0)
            group.destroy()
        if dead and not isinstance(e, TensorParallelError):
            raise TensorParallelFailure(f"tensor-parallel start-up failed: {'; '.join(dead)}") from e
        raise


def _wait_ready(workers: list[_Worker]) -> None:
    """Wait for every worker to be about to join the group (imports done, model resolved), or for one to die
    first: then its traceback is the error, rather than a rendezvous that waits for its timeout."""
    pending = {w.errors: w for w in workers}
    deadline = time.monotonic() + _START_TIMEOUT_S
    while pending:
        ready = wait(list(pending) + [w.process.sentinel for w in pending.values()],
                     timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            raise TensorParallelFailure(f"tensor-parallel workers {sorted(w.rank for w in pending.values())} did "
                                        f"not start within {_START_TIMEOUT_S:.0f} s")
        for w in list(pending.values()):
            if w.errors in ready and w.errors.poll():
                kind, text = w.errors.recv()
                if kind == "error":
                    w.report = text
                    raise TensorParallelFailure(f"tensor-parallel worker rank {w.rank} failed to start:\n{text}")
                del pending[w.errors]
            elif w.process.sentinel in ready:
                raise TensorParallelFailure(w.describe())


def _watch_parent(parent_pid: int) -> None:
    """Exit when the engine's process is gone (a worker stuck in an NCCL collective would not notice)."""
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(1)


def _worker_main(spec: _WorkerSpec, errors) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    threading.Thread(target=_watch_parent, args=(os.getppid(),), daemon=True).start()
    try:
        from ..model.loader import resolve
        from ..runner import ModelRunner

        torch.set_num_threads(spec.num_threads)
        device = torch.device(spec.device)
        src = resolve(spec.model)
        plan = plan_shards(_config(src), spec.world)[spec.rank]
        store = dist.TCPStore("127.0.0.1", spec.port, spec.world, is_master=False,
                              timeout=timedelta(seconds=_START_TIMEOUT_S))
        errors.send(("ready", None))
        shard = RankShard(plan, group.init(store, spec.rank, spec.world, device))
        runner = ModelRunner(src.hf_config, src.weight_slices, device=device, tp=shard, **spec.runner_kwargs)
        _serve_steps(runner, shard.comm)
    except BaseException:
        try:
            errors.send(("error", traceback.format_exc()))
        finally:
            os._exit(1)
    finally:
        group.destroy()


def _config(src):
    from ..model.llama import ModelConfig

    return ModelConfig.from_hf(src.hf_config)


def _serve_steps(runner, comm: group.Comm) -> None:
    """Run every step rank 0 broadcasts, until it says stop."""
    while True:
        header = torch.empty(_HEADER, dtype=torch.int64)
        dist.broadcast(header, 0, group=comm.control)
        values = header.tolist()
        if values[0] == _STOP:
            return
        step = _recv_step(comm, values)
        runner.run_on_device(runner._forward, *step)  # on the thread that built the shard (runner.py)
