"""Lowering to a plan of explicit operations (lmc.compiler.lower): every example's plan round-trips through JSON,
`lmc compile --emit plan` prints it, malformed plan data gets an error naming the operation, the score operation
decides multi-token selects as the interpreter does with less prefill, and the OpenAI backend runs exactly the
speculation groups the plan fixed."""
import copy
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import lmc
from lmc.backend.openai import program_usage, total_usage
from lmc.compiler.lower import Fork, Generate, Plan, PlanError, Score, format_plan
from lmc.compiler.pipeline import Target
from lmc.protocol import Capabilities, ChatTemplate

from conftest import API_KEY
from doubles import ScriptedBackend
from test_examples import PROGRAM_FILES, load

ROOT = Path(__file__).resolve().parent.parent
EXTRACTION = load("extraction")
KINDS = {"local": Capabilities(token_id_selects=True), "endpoint": Capabilities(),
         "openai": Capabilities(planned_speculation=True)}


def _program(name: str) -> lmc.Program:
    [prog] = [v for v in vars(load(name)).values() if isinstance(v, lmc.Program)]
    return prog


def _ops(ops):
    for o in ops:
        yield o
        for block in (o.branches if isinstance(o, Fork) else [o.then, o.otherwise] if hasattr(o, "then") else []):
            yield from _ops(block)


# ---- plans as data -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", PROGRAM_FILES)
def test_every_examples_plan_round_trips_through_json(name, tokenizer):
    compiled = _program(name).compile()
    for kind, caps in KINDS.items():
        plan = compiled.plan_for(Target(kind, ChatTemplate.from_tokenizer(tokenizer), tokenizer, caps))
        text = json.dumps(plan.to_json())
        back = Plan.from_json(text)
        assert back == plan and back.to_json() == plan.to_json()
        assert len(format_plan(back).splitlines()) >= len(list(_ops(plan.ops)))
        if kind != "local":
            assert all(o.token_ids is None for o in _ops(plan.ops) if isinstance(o, Score))


def test_a_served_segment_sends_its_plans_json_made_once_while_the_plan_lives():
    """lmc.compiler.remote sends each instance's segment as its plan's JSON, made once per plan (by identity),
    and forgets it when the plan goes."""
    import gc

    from lmc.compiler import remote

    plan = _program("judge").compile().plan_for(Target("endpoint", ChatTemplate.plain(), None, KINDS["endpoint"]))
    first = remote._plan_json(plan)
    assert remote._plan_json(plan) is first and first == plan.to_json()
    key = id(plan)
    del plan
    gc.collect()
    assert key not in remote._PLAN_JSON


def test_the_server_reads_a_plans_json_once_and_rejects_a_malformed_one_every_time():
    """lmc.compiler.hosted.load_program shares the plan read from the same JSON (a deployed program's instances
    all send it); a malformed plan is rejected every time it comes (errors are not kept)."""
    from lmc.compiler.hosted import ProgramRejected, load_program

    data = _data("judge", "endpoint")
    plan = load_program(data)
    assert load_program(copy.deepcopy(data)) is plan and plan.to_json() == data
    bad = copy.deepcopy(data)
    bad["ops"][0]["op"] = "teleport"
    for _ in range(2):
        with pytest.raises(ProgramRejected):
            load_program(bad)


def test_a_plan_is_lowered_per_backend_kind(tokenizer):
    tmpl = ChatTemplate.from_tokenizer(tokenizer)
    judge = _program("judge").compile()
    scores = {kind: [o for o in _ops(judge.plan_for(Target(kind, tmpl, tokenizer, caps)).ops) if isinstance(o, Score)]
              for kind, caps in KINDS.items()}
    assert all(o.token_ids is not None for o in scores["local"])  # one-token choices: the fast path
    assert all(o.token_ids is None and not o.prefill for o in scores["endpoint"] + scores["openai"])
    extract = _program("extraction").compile()
    gens = {kind: [o for o in _ops(extract.plan_for(Target(kind, tmpl, None, caps)).ops) if isinstance(o, Generate)]
            for kind, caps in KINDS.items()}
    assert [(o.spec.group, o.spec.first, o.spec.tokens) for o in gens["openai"]] == \
        [(0, True, 32), (0, False, 32), (0, False, 32)]
    assert all(o.spec is None for o in gens["local"] + gens["endpoint"])


def test_lmc_compile_emit_plan_prints_the_lowered_plan():
    base = [sys.executable, "-m", "lmc.cli", "compile", "examples/extraction.py"]
    out = subprocess.run(base + ["--emit", "plan", "--target", "openai"], capture_output=True, text=True, cwd=ROOT,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    plan = Plan.from_json(out.stdout)
    assert plan.target == "openai" and plan.speculation_tokens == 32
    assert [o.spec.first for o in plan.ops if isinstance(o, Generate)] == [True, False, False]
    text = subprocess.run(base + ["--emit", "plan-text", "--target", "openai"], capture_output=True, text=True,
                          cwd=ROOT, timeout=300)
    assert text.returncode == 0, text.stderr
    assert text.stdout == format_plan(plan)
    assert text.stdout.startswith("plan completion_body(doc) for openai") and "spec group 0 (first)" in text.stdout


def _data(name="judge", kind="local") -> dict:
    return _program(name).compile().plan_for(Target(kind, ChatTemplate.plain(), None, KINDS[kind])).to_json()


def _first(ops: list, kind: str) -> tuple[str, dict]:
    """The path and data of the first operation of `kind` (pre-order)."""
    for i, o in enumerate(ops):
        if o["op"] == kind:
            return f"ops[{i}]", o
        for k, block in enumerate(o.get("branches", [])):
            for j, inner in enumerate(block):
                if inner["op"] == kind:
                    return f"ops[{i}].branches[{k}][{j}]", inner
    raise AssertionError(kind)


def test_malformed_plan_json_names_the_operation():
    data = _data()
    path, gen = _first(data["ops"], "generate")
    bad = copy.deepcopy(data)
    _first(bad["ops"], "generate")[1]["params"]["max_tokenz"] = 3
    with pytest.raises(PlanError, match=rf"^{re.escape(path)} \(generate %{gen['node']}\): unknown sampling option"
                                        r"\(s\) \['max_tokenz'\]; the options are: max_new_tokens"):
        Plan.from_json(bad)
    bad = copy.deepcopy(data)
    _first(bad["ops"], "score")[1]["temperature"] = "hot"
    spath, score = _first(data["ops"], "score")
    with pytest.raises(PlanError, match=rf"{re.escape(spath)} \(score %{score['node']}\): temperature: must be "
                                        r"float, not \"hot\""):
        Plan.from_json(bad)
    bad = copy.deepcopy(data)
    _first(bad["ops"], "score")[1]["token_ids"] = [1]
    with pytest.raises(PlanError, match=rf"score %{score['node']}\): 1 token ids for 5 choices"):
        Plan.from_json(bad)
    bad = copy.deepcopy(data)
    _first(bad["ops"], "score")[1]["method"] = "MyMethod"
    with pytest.raises(PlanError, match=rf"score %{score['node']}: choice method 'MyMethod'"):
        Plan.from_json(bad)
    bad = copy.deepcopy(data)
    jpath, join = _first(bad["ops"], "join")
    join["fork"] = 999
    with pytest.raises(PlanError, match=rf"{re.escape(jpath)} \(join %{join['node']}\): joins fork %999"):
        Plan.from_json(bad)
    bad = copy.deepcopy(data)
    bad["ops"][0]["op"] = "teleport"
    with pytest.raises(PlanError, match=r"ops\[0\]: unknown operation 'teleport'; the operations are: extend"):
        Plan.from_json(bad)
    bad = copy.deepcopy(data)
    del bad["ops"][0]["node"]
    with pytest.raises(PlanError, match=r"ops\[0\] \(extend %\?\): missing field 'node'"):
        Plan.from_json(bad)
    bad = copy.deepcopy(data)
    bad["ops"][0]["parts"][1] = {"text": "a", "arg": "question"}
    with pytest.raises(PlanError, match=r"ops\[0\] \(extend %0\): parts\[1\]: a part sets exactly one"):
        Plan.from_json(bad)
    bad = copy.deepcopy(data)
    bad["ops"].insert(len(bad["ops"]) - 1, bad["ops"][-1])  # a break that is not the block's last operation
    with pytest.raises(PlanError, match=r"\(break %\d+\): must be the last operation of its block"):
        Plan.from_json(bad)
    with pytest.raises(PlanError, match="version 7"):
        Plan.from_json({**data, "version": 7})
    with pytest.raises(PlanError, match="not JSON"):
        Plan.from_json("{ops: [")


# ---- the score operation on the local engine ---------------------------------------------------------------------
SYSTEM = ("You are a careful assistant who answers questions about everyday facts. Think about what the user asks, "
          "then pick the answer that fits best from the ones offered, without explaining yourself.")


@lmc.function
def pick(s, question):
    s += lmc.system(SYSTEM)
    s += lmc.user(question + " Choose the best description of your answer from the options I will give you now.")
    s += lmc.assistant(lmc.select("answer", choices=["certainly yes", "no way at all", "it depends"]))


def test_a_multi_token_score_prefills_its_prompt_only_where_the_engine_shares_no_prefix_in_a_batch(tokenizer):
    tmpl, compiled = ChatTemplate.from_tokenizer(tokenizer), pick.compile()
    for sharing in (False, True):
        caps = Capabilities(token_id_selects=True, batch_prefix_sharing=sharing)
        [score] = [o for o in compiled.plan_for(Target("local", tmpl, tokenizer, caps)).ops if isinstance(o, Score)]
        # without sharing: one prefill, then the choices as extensions; with it the choices' one engine call
        # shares the prompt already, and a prefill would cost the select a round trip of its own
        assert score.token_ids is None and score.prefill is not sharing


class SharingScriptedBackend(ScriptedBackend):
    """The scripted double on a backend that computes a prefix shared by queued requests once."""
    capabilities = Capabilities(batch_prefix_sharing=True)


def test_a_fork_prefills_its_parent_only_where_the_backend_shares_no_prefix_in_a_batch(tokenizer):
    tmpl, judge = ChatTemplate.from_tokenizer(tokenizer), _program("judge").compile()
    for sharing in (False, True):
        caps = Capabilities(token_id_selects=True, batch_prefix_sharing=sharing)
        [fork] = [o for o in _ops(judge.plan_for(Target("local", tmpl, tokenizer, caps)).ops) if isinstance(o, Fork)]
        # with sharing the branches, queued together, compute the parent's uncached text once among themselves
        assert fork.commit and fork.prefill is not sharing
    args = {"question": "What is 2 + 2?", "answer": "4."}
    for backend, commits in ((ScriptedBackend("1"), 1), (SharingScriptedBackend("1"), 0)):
        state = judge.run(**args, backend=backend)
        assert state["scores"] == {"clarity": 1, "accuracy": 1, "relevance": 1}  # ran through its branches
        # (the selects' prompt prefills are commits too: count the fork's)
        assert sum(kind == "commit" and text.endswith(fork.commit) for kind, text in backend.calls) == commits


def test_multi_token_choices_are_scored_by_the_score_op_as_the_interpreter_decides(engine):
    backend = lmc.Local(engine=engine)
    compiled = pick.compile()
    [score] = [o for o in compiled._plan(compiled.graph(), backend).ops if isinstance(o, Score)]
    assert score.token_ids is None and score.prefill is not engine.scheduler.shares_prefixes_in_batch
    # The questions start with different words and the warm-up caches what they all share (the system turn and
    # the user turn's opening), so no instance shares uncached tokens with another: the counts do not depend on
    # whether the instances reach the engine in one step or in several (a share below IN_BATCH_DEPRIORITIZE is
    # computed by each request of one batch, but cached for a later one).
    args = [{"question": q} for q in ("Is the sky blue on a clear day?", "Do fish need water to live?",
                                      "Will it rain tomorrow in London?")]
    turns = engine.tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM},
                                                  {"role": "user", "content": "\x00"}], tokenize=False)
    computed = {}
    for mode in ("interpreted", "compiled"):
        engine.flush_cache()
        engine.generate(turns[:turns.index("\x00")], {"max_new_tokens": 0})
        before = engine.stats()["computed_tokens"]
        states = (pick if mode == "interpreted" else compiled).run_batch(args, backend=backend, temperature=0)
        computed[mode] = engine.stats()["computed_tokens"] - before
        if mode == "interpreted":
            interpreted = states
    for got, want in zip(states, interpreted):
        assert got.text() == want.text() and got.variables() == want.variables()
        assert got.get_meta_info("answer")["normalized_prompt_logprobs"] == \
            pytest.approx(want.get_meta_info("answer")["normalized_prompt_logprobs"], abs=1e-4)
    # each instance's uncached question is computed once, not once per choice (by the prefill, or by the engine's
    # in-batch sharing, which serves the interpreter's requests too)
    assert computed["compiled"] <= computed["interpreted"]


# ---- planned API speculation -------------------------------------------------------------------------------------
DOCS = ["Marie Curie (7 November 1867 - 4 July 1934) was a Polish physicist and chemist who conducted pioneering "
        "research on radioactivity.",
        "Albert Einstein (14 March 1879 - 18 April 1955) was a German-born theoretical physicist who developed the "
        "theory of relativity.",
        "Ada Lovelace (10 December 1815 - 27 November 1852) was an English mathematician and writer, chiefly known "
        "for her work on the Analytical Engine.",
        "Louis Pasteur (27 December 1822 - 28 September 1895) was a French chemist and microbiologist renowned for "
        "his discoveries of vaccination."]


@pytest.fixture(scope="module")
def completion_backend(server):
    b = lmc.OpenAI("smollm2", base_url=server.url + "/v1", api_key=API_KEY, is_chat_model=False)
    yield b
    b.shutdown()


def test_the_openai_backend_runs_exactly_the_planned_speculation_groups(completion_backend):
    extraction = EXTRACTION
    args = [{"doc": d} for d in DOCS]
    plain = lmc.function(extraction.completion_body).run_batch(args, backend=completion_backend, temperature=0)
    compiled = extraction.extract.compile()
    plan = compiled._plan(compiled.graph(), completion_backend)  # the plan run_batch runs on this backend
    groups = [(o.name, o.spec.group) for o in plan.ops if isinstance(o, Generate)]
    assert groups == [("name", 0), ("birth", 0), ("job", 0)]
    spec = compiled.run_batch(args, backend=completion_backend, temperature=0)
    for s, p in zip(spec, plain):
        assert s.variables() == p.variables()  # compiled == interpreted at temperature 0
        metas = [s.get_meta_info(name) for name, _ in groups]
        assert all(m["speculative"] and m["spec_group"] == 0 for m in metas)
        assert len({m["spec_call_id"] for m in metas}) == 1  # the group's one call served all three
    u = total_usage(spec)
    assert (u.calls, u.calls_saved) == (len(args), 2 * len(args))
    # Nothing planned, nothing speculated: with the pass off the backend does not decide on its own, though the
    # program asks for num_api_spec_tokens (the interpreted run of the same program speculates at run time).
    off = extraction.extract.compile(disable=["api_speculation"]).run_batch(args, backend=completion_backend,
                                                                          temperature=0)
    uo = total_usage(off)
    assert (uo.calls, uo.calls_saved) == (3 * len(args), 0)
    assert [s.variables() for s in off] == [p.variables() for p in plain]
    assert all("speculative" not in s.get_meta_info("job") for s in off)
    interpreted = extraction.extract.run_batch(args, backend=completion_backend, temperature=0)
    assert total_usage(interpreted).calls_saved > 0


@lmc.function(num_api_spec_tokens=32)
def two_documents(s, doc, other):
    s += EXTRACTION.INSTRUCTION + EXTRACTION.EXAMPLES + "Text: " + doc + "\n"
    EXTRACTION.fields(s)
    s += "\n\nText: " + other + "\n"  # an argument between the runs: a second group
    EXTRACTION.fields(s)


def test_planned_groups_split_where_the_plan_says(completion_backend):
    compiled = two_documents.compile()
    plan = compiled._plan(compiled.graph(), completion_backend)
    planned = [(o.node, o.spec.group, o.spec.first) for o in plan.ops if isinstance(o, Generate)]
    assert [(g, f) for _, g, f in planned] == [(0, True), (0, False), (0, False), (1, True), (1, False), (1, False)]
    state = compiled.run(doc=DOCS[0], other=DOCS[1], backend=completion_backend, temperature=0)
    ref = lmc.function(two_documents.func).run(doc=DOCS[0], other=DOCS[1], backend=completion_backend,
                                               temperature=0)
    assert state.variables() == ref.variables()
    u = program_usage(state)
    assert u.calls + u.calls_saved == 6 and u.calls >= 2  # two speculative calls at least, one per group
    metas = [state.get_meta_info(n) for n in ("name", "birth", "job")]  # the second document's (same names)
    assert all(m.get("spec_group") == 1 for m in metas if m.get("speculative"))
