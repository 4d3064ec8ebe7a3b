"""The scheduler, on mini-sglang's module boundaries:

- scheduler.py: `Scheduler`, the step (overlap or not), failure isolation, output processing, finishing;
- prefill.py: admission (budgets, chunked prefill, in-batch prefix dedup, mixing decode into short extends);
- decode.py: the decode step and retraction;
- policy.py: the admission order (`program`, `lpm`, `dfs-weight`, `fcfs`, `random`; a registry new policies join);
- programs.py: `ProgramLedger`, the program instances behind hinted requests, and KV retention by next use;
- cache.py: `CacheManager`, the rows, slots and radix tree, and the slot accounting;
- config.py: `SchedulerConfig` and SGLang's admission constants.
Jump-forward lives next door in runtime/jump_forward.py.
"""
from .config import SchedulerConfig
from .policy import POLICIES
from .scheduler import Scheduler

__all__ = ["POLICIES", "Scheduler", "SchedulerConfig"]
