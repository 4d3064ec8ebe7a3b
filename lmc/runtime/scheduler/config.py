"""Scheduler configuration and the constants of SGLang's admission rules."""
from __future__ import annotations

from dataclasses import dataclass

CLIP_NEW_TOKENS = 4096  # cap on the per-request output estimate used by admission (SGLang's constant)
# A request waits a step when requests admitted before it in this batch carry at least this many of its tokens
# beyond its cached match. SGLang checks only requests matching <= 32 cached tokens; lmc checks every request, so
# programs sharing a cached header still share the longer prefix their batch-mates compute (suite: mmlu computed
# one 26-token subject block 4 times per program under SGLang's rule).
IN_BATCH_DEPRIORITIZE = 32
MIX_MAX_EXTEND = 64  # running requests decode inside a prefill of jump-forward extends at most this long


@dataclass
class SchedulerConfig:
    policy: str = "program"  # a name in policy.POLICIES
    max_running: int = 256
    max_prefill_tokens: int = 16384
    chunked_prefill_size: int = 8192
    init_new_token_ratio: float = 0.7
    min_new_token_ratio: float = 0.098
    new_token_ratio_decay_steps: int = 600
    retract_reserve_steps: int = 20
    # Ablation knob (benchmarks only, the paper's Figure 8): the share of requests, drawn by the scheduler's seeded
    # RNG when they arrive, whose cached prefix is ignored, so the hit rate drops while everything else is unchanged.
    match_drop_rate: float = 0.0
