"""Tensor parallelism over torch.distributed (NCCL on CUDA, gloo on the CPU): the model sharded across ranks
(plan.py, layers.py), rank 0 in the engine process with the scheduler, one worker process per other rank running
the same forwards (workers.py)."""
from .plan import ShardPlan, TensorParallelError, plan_shards

__all__ = ["ShardPlan", "TensorParallelError", "TensorParallelFailure", "plan_shards", "start_runner"]


def __getattr__(name):  # the process machinery imports the runner: loaded on first use
    if name in ("TensorParallelFailure", "start_runner"):
        from . import workers

        return getattr(workers, name)
    raise AttributeError(name)
