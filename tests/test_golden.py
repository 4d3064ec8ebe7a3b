"""Golden files (tests/golden/*.lmir, written by `lmc compile`), checked by something other than the code that
wrote them. test_compiler.py checks that they are what `lmc compile` prints today, that they round-trip through
the text format and that the report agrees with itself; here:
- the graph in the file (parsed and validated, not the traced program) costs what the file says;
- where the passes make the estimate worse, the file says why, and the reason holds: the passes' hints are a
  fixed cost, so with many instances the passes are not worse;
- the cost model's counts are what the engine counts when it runs the program on the same instances.
"""
import json
from pathlib import Path

import pytest

import lmc as sgl
from lmc.ir.text import parse_graph
from lmc.passes import constant_prefix, fork_commit_texts
from lmc.passes.cost import estimate, first_prompts, token_aligned_hint
from lmc.protocol import ChatTemplate

GOLDEN = Path(__file__).parent / "golden"
NAMES = sorted(p.stem for p in GOLDEN.glob("*.lmir"))


def golden(name: str):
    """The file's graph (validated) and its report comments."""
    text = (GOLDEN / f"{name}.lmir").read_text()
    g = parse_graph(text).validate()
    report = {ln[2:].split(": ", 1)[0]: json.loads(ln[2:].split(": ", 1)[1])
              for ln in text.splitlines() if ln.startswith("# ")}
    return g, report


def hints(g, report: dict, template, tokenize, instances: list[dict]) -> dict:
    """The passes' hints for these instances, from the file's graph and the passes the file lists."""
    passes = set(report["passes"])
    prefix = constant_prefix(g, template) if "batch_prefix" in passes else ""
    return {"batch_prefix": token_aligned_hint(prefix, first_prompts(g, template, instances), tokenize) if prefix
            else "",
            "fork_commits": fork_commit_texts(g, template) if "fork_commit" in passes else {},
            "lowered_selects": frozenset(int(n[1:]) for n in report["select_lowering"])}


@pytest.fixture(scope="module")
def template(tokenizer):
    return ChatTemplate.from_tokenizer(tokenizer)


def test_there_are_golden_files():
    assert {"few_shot_qa", "classification", "tip_suggestion"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_the_files_graph_costs_what_the_file_says(name, tokenizer, template):
    g, report = golden(name)
    tok, two = tokenizer.encode, [{}, {}]
    cost = report["cost"]
    assert estimate(g, template, tok, two, cache=False).as_dict() == cost["no_cache"]
    assert estimate(g, template, tok, two).as_dict() == cost["radix_cache"]
    passes = hints(g, report, template, tok, two)
    assert estimate(g, template, tok, two, **passes).as_dict() == cost["radix_cache_and_passes"]
    prefix = passes["batch_prefix"]
    assert report["prefix_hoist"]["batch_prefix_tokens"] == (len(tok(prefix)) if prefix else 0)


@pytest.mark.parametrize("name", NAMES)
def test_the_passes_make_the_estimate_worse_only_saying_why_and_the_why_holds(name, tokenizer, template):
    g, report = golden(name)
    tok, cost = tokenizer.encode, report["cost"]
    worse = cost["radix_cache_and_passes"]["prefill_tokens"] - cost["radix_cache"]["prefill_tokens"]
    assert ("note" in cost) == (worse > 0)
    many = [{}] * 16  # the hints' cost is per batch: 16 instances amortise it
    plain = estimate(g, template, tok, many).prefill_tokens
    with_passes = estimate(g, template, tok, many, **hints(g, report, template, tok, many)).prefill_tokens
    assert with_passes <= plain, f"the passes cost {with_passes - plain} more prefill tokens even over 16 instances"


# The programs whose every model call's prompt the cost model knows exactly (no generated text precedes a call),
# and whether it knows the engine's cache hits too: the choices of a select go to the engine as one batch, and
# whether one choice's fresh tokens serve the others depends on the scheduler's in-batch sharing, which the cost
# model does not replay (it counts the choices one after another).
ENGINE_CHECKED = {"few_shot_qa": True, "classification": False}


@pytest.mark.parametrize("name", sorted(ENGINE_CHECKED))
def test_the_cost_model_counts_what_the_engine_counts(name, engine):
    """The file's no-cache prompt tokens are the engine's prompt tokens for the same two instances (the cost
    model's placeholders as arguments), run one after another; with the cache, the engine's prefill tokens are
    the file's radix-cache prefill tokens."""
    from test_compiler import load_example

    g, report = golden(name)
    prog, backend = load_example(name), sgl.Local(engine=engine)
    engine.flush_cache()
    before = dict(engine.stats())
    for i in range(2):
        state = prog.run(backend=backend, temperature=0, **{p: f"<{p} #{i}>" for p in g.params})
        assert state.error() is None
    after = engine.stats()
    prompt = after["prompt_tokens"] - before["prompt_tokens"]
    cached = after["cached_tokens"] - before["cached_tokens"]
    assert prompt == report["cost"]["no_cache"]["prompt_tokens"]
    if ENGINE_CHECKED[name]:
        assert prompt - cached == report["cost"]["radix_cache"]["prefill_tokens"]
