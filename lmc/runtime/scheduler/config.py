"""Scheduler configuration and the constants of SGLang's admission rules."""
from __future__ import annotations

from dataclasses import dataclass

CLIP_NEW_TOKENS = 4096  # cap on the per-request output estimate used by admission (SGLang's constant)
# A request waits a step when requests admitted before it in this batch carry at least this many of the tokens it
# could take from the cache beyond its cached match. SGLang checks only requests matching <= 32 cached tokens and
# defers at 32 shared tokens; lmc checks every request (suite: mmlu computed one 26-token subject block 4 times per
# program under SGLang's rule) and defers at 4: a fork's branches share the 19-token turn after a generated plan
# and their 5-6-token chat-template header, which a 32-token rule recomputed per branch (tree_of_thought at 93% of
# the optimal hit rate; at the optimum with 4, 98.5% with 8). Below 4, a request would wait a step to save a token
# or two (prompts starting with the same word).
IN_BATCH_DEPRIORITIZE = 4
MIX_MAX_EXTEND = 64  # running requests decode inside a prefill of jump-forward extends at most this long
CHAIN_BATCH_STEPS = 8  # SchedulerConfig.chain_batch_steps on a device whose decode steps replay CUDA graphs


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
    # Forward shaping for latency under load (policy.ProgramAware's docstring; prefill.py): while requests carrying
    # program hints decode, a prefill batch takes at most this many new tokens and the running requests decode in
    # it. None: SGLang's rules (prefill up to the budgets above, decoding stalled while it runs).
    busy_prefill_tokens: int | None = None
    # Ablation knob (benchmarks only, the paper's Figure 8): the share of requests, drawn by the scheduler's seeded
    # RNG when they arrive, whose cached prefix is ignored, so the hit rate drops while everything else is unchanged.
    match_drop_rate: float = 0.0
    # Where decode steps replay a CUDA graph but a prefill forward runs eagerly (SmolLM2-135M on the H200: ~25 ms of
    # host launches for an eager forward of its 30 layers, ~1.5 ms for a replayed decode step of 32 requests;
    # results/h200_probe/fwd_probe_before.json), a chain's next text waits in `continuing` up to this many decode steps
    # while requests decode, so that the chains of a batch's instances extend together in one eager forward instead
    # of one each. 0 (the CPU, where a forward costs by the tokens it computes): each extends at the next step.
    chain_batch_steps: int = 0
