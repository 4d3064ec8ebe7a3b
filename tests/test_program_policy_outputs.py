"""Nothing changes outputs (issue 14): compiled programs, whose requests carry program hints, give the same variables
at temperature 0 under every schedule policy, several instances in flight at once on the session engine; and a lone
chain instance (whose selects the engine fuses with the next gen: latency fusion) under every policy, with
continuation on and off."""
import sys
from pathlib import Path

import pytest

import lmc as sgl

SUITE = Path(__file__).resolve().parents[1] / "benchmarks" / "suite"
sys.path.insert(0, str(SUITE))
from workloads import judge, tree_of_thought  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from few_shot_qa import few_shot_qa  # noqa: E402
from programs_support import chain  # noqa: E402

PROGRAMS = {
    "tree_of_thought": (tree_of_thought, [{"question": q, "plan_tokens": 6, "solution_tokens": 6}
                                          for q in ("What is 2 + 3?",)]),  # 2 x 2 forks: 6 calls at once
    "judge": (judge, [{"title": t, "article": a, "judgement_tokens": 6}
                      for t, a in (("Cats", "Cats sleep a lot."),)]),  # 4 branches at once, then the merge
    "few_shot_qa": (few_shot_qa, [{"question": f"What is the capital of {c}?"} for c in ("France", "Spain")]),
    "chain": (chain, [{"topic": "the moon"}]),  # one instance: its selects by ids are fused (latency fusion)
}


@pytest.mark.parametrize("name", list(PROGRAMS))
def test_same_variables_under_every_policy(engine, name):
    prog, batch = PROGRAMS[name]
    compiled = prog.compile()
    backend = sgl.Local(engine=engine)
    seen_hints, fused = [], []
    before = engine.scheduler.cfg.policy
    results = {}
    try:
        for policy in ("program", "lpm", "dfs-weight", "fcfs"):
            engine.scheduler.cfg.policy = policy
            engine.flush_cache()
            start = engine.stats()["fused_selects"]
            states = compiled.run_batch(batch, backend=backend, temperature=0)
            fused.append(engine.stats()["fused_selects"] - start)
            results[policy] = [s.variables() for s in states]
            seen_hints.append(engine.scheduler.memory.programs.retaining)
    finally:
        engine.scheduler.cfg.policy = before
    assert all(results[p] == results["program"] for p in results), results
    assert seen_hints == [True, False, False, False]  # retention by the plan engaged under `program` only
    if name == "chain":
        assert fused == [2, 2, 2, 2]  # latency fusion under every policy
        engine.enable_continuation = False
        try:
            states = compiled.run_batch(batch, backend=backend, temperature=0)
        finally:
            engine.enable_continuation = True
        assert [s.variables() for s in states] == results["program"]
