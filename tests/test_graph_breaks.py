"""Graph breaks: host code that reads generated values compiles into segments, runs compiled with the same
variables and text as interpreted (temperature 0, the embedded model), and resumed segments are reused behind
guards. Also the frontend idioms compiled programs must keep (forks[i] +=, custom choice methods)."""
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from doubles import DelayedCalls, GatedBackend

import lmc as sgl
from lmc.compiler.trace import trace

ROOT = Path(__file__).resolve().parent.parent
TOOLS = {"paris": "France", "rome": "Italy", "tokyo": "Japan"}


@pytest.fixture(scope="module")
def backend(engine):
    return sgl.Local(engine=engine)


def same(prog, backend, **args):
    """Run interpreted and compiled; both modes give the same variables and text. Returns the compiled program."""
    interpreted = prog.run(backend=backend, temperature=0, **args)
    compiled = prog.compile()
    state = compiled.run(backend=backend, temperature=0, **args)
    assert state.variables() == interpreted.variables()
    assert state.text() == interpreted.text()
    return compiled


@sgl.function
def unnamed(s, topic):
    s += "A word about " + topic + ":" + sgl.gen(max_tokens=3, stop="\n") + " Good?" + sgl.select(choices=[" yes", " no"])


def test_unnamed_gens_set_no_variables_compiled(backend):
    state = same(unnamed, backend, topic="rain").run(topic="rain", backend=backend, temperature=0)
    assert state.variables() == {}


@sgl.function
def dict_lookup(s, city):
    s += "City: " + city + "\nIs it a capital? Answer yes or no: " + sgl.select("capital", choices=["yes", "no"])
    s += "\nCountry: " + TOOLS.get(s["capital"], "unknown") + "\n"  # a dict lookup of a generated value
    s += "Another city in Europe:" + sgl.gen("other", max_tokens=4, stop="\n")


@sgl.function
def parse_numbers(s, question):
    s += question + "\nAnswer with a number: " + sgl.gen("n", max_tokens=3, regex="[1-9]")
    doubled = int(s["n"]) * 2 + float(s["n"])  # int() and float() of generated text
    s += f"\nThree times that is {doubled:g}. Say why:" + sgl.gen("why", max_tokens=6, stop="\n")


@sgl.function
def str_methods(s, name):
    s += "Write a word about " + name + ":" + sgl.gen("word", max_tokens=4, stop="\n")
    cleaned = s["word"].strip(" .,!").replace(" ", "-").upper()  # str methods with arguments
    s["cleaned"] = cleaned
    s += f"\nThe word was {cleaned}. Another:" + sgl.gen("again", max_tokens=4, stop="\n")


@sgl.function
def counted_loop(s, topic):
    s += f"How many {topic} can you name? Answer 2 or 3: " + sgl.gen("count", max_tokens=2, regex="[23]")
    for i in range(int(s["count"])):  # a loop whose trip count is generated
        s += f"\n{i + 1}." + sgl.gen(f"item_{i}", max_tokens=4, stop="\n")


@sgl.function
def meta_read(s, question):
    s += question + " Answer yes or no: " + sgl.select("ok", choices=["yes", "no"])
    lps = s.get_meta_info("ok")["normalized_prompt_logprobs"]
    s += f"\nMargin: {lps[0] - lps[1]:.2f}. How sure are you?" + sgl.gen("sure", max_tokens=4, stop="\n")  # formatted


def tool(text: str) -> str:
    import re

    match = re.search(r"\d+", text)  # a C function: it needs a real str
    return str(int(match.group()) ** 2) if match else "no number"


@sgl.function
def tool_call(s, question):
    s += question + "\nNumber:" + sgl.gen("number", max_tokens=3, regex=" [1-9]")
    s += "\nIts square: " + tool(s["number"]) + "\nNice?" + sgl.select("nice", choices=[" yes", " no"])


@sgl.function
def generated_fork(s, topic):
    s += f"How many facts about {topic}? Answer 2 or 3: " + sgl.gen("k", max_tokens=2, regex="[23]")
    forks = s.fork(int(s["k"]))  # the fork's size is generated
    for i, f in enumerate(forks):
        f += f"\nFact {i + 1}:" + sgl.gen("fact", max_tokens=5, stop="\n")
    forks.join()


PROGRAMS = {dict_lookup: {"city": "Paris"}, parse_numbers: {"question": "How many legs has a cat?"},
            str_methods: {"name": "the sea"}, counted_loop: {"topic": "fruits"},
            meta_read: {"question": "Is the sky blue?"}, tool_call: {"question": "Pick a small number."},
            generated_fork: {"topic": "cats"}}


@pytest.mark.parametrize("prog", list(PROGRAMS), ids=lambda p: p.__name__)
def test_host_code_is_a_graph_break_and_runs_like_the_interpreter(backend, prog):
    compiled = prog.compile()
    fallback, breaks = compiled.breaks()
    assert not fallback and breaks and all(b["line"].startswith("test_graph_breaks.py:") for b in breaks)
    assert all("interpreted_from_here" not in b for b in breaks)
    same(prog, backend, **PROGRAMS[prog])
    assert compiled.stats["interpreted_rests"] == 0 or prog is tool_call


def test_a_segment_is_reused_by_instances_that_read_the_same_values(backend):
    compiled = counted_loop.compile()
    states = compiled.run_batch([{"topic": "fruits"}] * 3 + [{"topic": "colors"}], backend=backend, temperature=0)
    counts = [st["count"] for st in states]
    assert [len([k for k in st.variables() if k.startswith("item_")]) for st in states] == [int(c) for c in counts]
    # One batch traces each path once, though its instances reach the break together (single-flight tracing).
    paths = len(set(counts))
    assert compiled.stats["segments_traced"] == paths and compiled.stats["segment_reuses"] == 4 - paths
    again = compiled.run_batch([{"topic": "fruits"}] * 3 + [{"topic": "colors"}], backend=backend, temperature=0)
    assert [st["count"] for st in again] == counts
    assert compiled.stats["segments_traced"] == paths and compiled.stats["segment_reuses"] == 8 - paths


def _batch(compiled, items, backend, timeout=60):
    """run_batch with a deadline: a wedged batch fails the test instead of hanging it."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(compiled.run_batch, items, backend=backend, temperature=0).result(timeout)


def _slow_traces(monkeypatch, compiled, **kw) -> DelayedCalls:
    """Resumed traces that take a while (the first segment traced before), so instances overlap them."""
    import lmc.compiler.compiled as compiled_module

    compiled.graph()
    slow = DelayedCalls(compiled_module.trace_segment, **kw)
    monkeypatch.setattr(compiled_module, "trace_segment", slow)
    return slow


def test_instances_that_reach_a_break_together_trace_it_once(monkeypatch):
    """Eight instances reach the break at the same moment (the double answers their gens together) while its
    trace takes 0.2 s: one traces, seven wait and reuse."""
    compiled = counted_loop.compile()
    slow = _slow_traces(monkeypatch, compiled)
    states = _batch(compiled, [{"topic": f"topic {i}"} for i in range(8)], GatedBackend(8, "2"))
    assert all(st.error() is None and st["item_1"] == "2" for st in states)
    assert slow.calls == 1 and compiled.stats["segments_traced"] == 1 and compiled.stats["segment_reuses"] == 7
    assert 0.2 <= compiled.stats["trace_seconds"] < 5  # the one slow trace, counted once


def test_a_failed_trace_does_not_wedge_the_instances_waiting_for_it(monkeypatch):
    compiled = counted_loop.compile()
    slow = _slow_traces(monkeypatch, compiled, fail_first=True)
    states = _batch(compiled, [{"topic": f"topic {i}"} for i in range(4)], GatedBackend(4, "2"))
    errors = [st.error() for st in states]
    assert [str(e) for e in errors if e is not None] == ["injected failure"]  # only the instance that traced
    assert all(st["item_1"] == "2" for st, e in zip(states, errors) if e is None)
    # The failed trace, then one waiter's trace that the others reuse.
    assert slow.calls == 2 and compiled.stats["segments_traced"] == 1 and compiled.stats["segment_reuses"] == 2


def test_a_resumed_segment_reads_executed_values_under_guards():
    """The segment after a break is traced with the executed values: what the host code read is its guard."""
    from lmc.compiler.trace import Resume, trace_segment

    first = trace(dict_lookup)
    [brk] = first.breaks()
    [select] = [n for n in first.order() if first.node(n).kind == "select"]
    op = first.op_of[select]
    resume = Resume(ops=first.node(brk).attrs["resume"], history={op: {"capital": ("yes", {})}}, args={"city": "X"})
    seg = trace_segment(dict_lookup, {}, resume)
    g = seg.graph.validate()
    assert g.inputs == ("capital",) and seg.guards == {("var", op, "capital"): "yes"}
    texts = [g.node(n).attrs.get("value") for n in g.order() if g.node(n).kind == "text"]
    assert texts[0] == "\nCountry: unknown\n"  # TOOLS.get("yes") read the concrete value


@sgl.function
def fork_index_append(s, topic):
    s += "Two words about " + topic + ":"
    forks = s.fork(2)
    for i in range(2):
        forks[i] += f" word {i + 1}:" + sgl.gen("w", max_tokens=3, stop="\n")  # SGLang's idiom
    forks.join()


def test_fork_item_append_works_in_both_modes(backend):
    state = same(fork_index_append, backend, topic="rain").run(topic="rain", backend=backend, temperature=0)
    assert len(state["w"]) == 2
    forks = sgl.ProgramStateGroup([], None)
    with pytest.raises(TypeError, match="cannot be replaced"):
        forks.states.append(object())
        forks[0] = "other"


@sgl.function
def merge_branch_values(s, topic):
    s += "Two words about " + topic + ":"
    forks = s.fork(2)
    for i, f in enumerate(forks):
        f += f" word {i + 1}:" + sgl.gen("w", max_tokens=3, stop="\n")
    forks.join()
    for i in range(2):  # branch-solve-merge: each branch's own value, not the gathered list
        s += f"\nWord {i + 1} was" + forks[i]["w"]
    s += "\nBetter one:" + sgl.gen("best", max_tokens=3, stop="\n")


def test_branch_variables_read_after_the_join_are_the_branchs_own(backend):
    state = same(merge_branch_values, backend, topic="rain").run(topic="rain", backend=backend, temperature=0)
    first, second = state["w"]
    assert f"Word 1 was{first}" in state.text() and f"Word 2 was{second}" in state.text()


class LastChoiceWins(sgl.ChoicesSamplingMethod):
    """A user-defined method: the choice with the lowest mean logprob (so it differs from the default)."""

    def __call__(self, *, choices, normalized_prompt_logprobs, **kw):
        worst = min(range(len(choices)), key=lambda i: normalized_prompt_logprobs[i])
        return sgl.ChoicesDecision(choices[worst], {"normalized_prompt_logprobs": normalized_prompt_logprobs})


@sgl.function
def custom_method(s, question):
    s += question + " Answer:" + sgl.select("a", choices=[" yes", " no", " maybe"], choices_method=LastChoiceWins())


def test_a_user_defined_choice_method_runs_compiled(backend):
    same(custom_method, backend, question="Is water wet?")


def test_every_example_compiles_without_falling_back():
    from test_compiler import load_example

    names = [p.stem for p in (ROOT / "examples").glob("*.py") if p.stem != "quickstart"]
    assert {"calculator_agent", "counted_list"} <= set(names)
    for name in names:
        prog = load_example(name)
        fallback, breaks = prog.compile().breaks()
        assert not fallback, (name, breaks)
        assert all("interpreted_from_here" not in b for b in breaks), (name, breaks)


def test_lmc_compile_emits_one_json_object_with_the_report():
    out = subprocess.run([sys.executable, "-m", "lmc.cli", "compile", "examples/react_agent.py:react_agent",
                          "--emit", "json"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["report"]["fallback"] is False and doc["graph"]["name"] == "react_agent"
    lines = {b["line"] for b in doc["report"]["graph_breaks"]}
    assert lines and all(line.startswith("react_agent.py:") for line in lines)
    assert all(isinstance(b["reason"], str) and b["reason"] for b in doc["report"]["graph_breaks"])


def test_lmc_compile_emits_the_executors_plan():
    out = subprocess.run([sys.executable, "-m", "lmc.cli", "compile", "examples/judge.py", "--emit", "plan"],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    [fork] = [op for op in doc["ops"] if op["op"] == "fork"]
    scores = [op for branch in fork["branches"] for op in branch if op["op"] == "score"]
    assert doc["target"] == "local" and len(scores) == 3
    assert all(len(op["token_ids"]) == len(op["choices"]) for op in scores)  # one-token scores
    assert fork["commit"] and fork["batch"] is True


@sgl.function
def repeat_words(s, word, n=2):
    for i in range(n):
        s += f" {word}" + sgl.gen(f"w{i}", max_tokens=2)


def test_run_batch_with_different_non_text_arguments(backend):
    """Instances specialised on different loop counts run in one batch, each like the interpreter."""
    items = [{"word": "sun", "n": 1}, {"word": "moon", "n": 3}, {"word": "star"}]
    compiled = repeat_words.compile()
    states = compiled.run_batch(items, backend=backend, temperature=0)
    for state, ref in zip(states, repeat_words.run_batch(items, backend=backend, temperature=0)):
        assert state.variables() == ref.variables() and state.text() == ref.text()
    assert len(compiled._graphs) == 3  # one first segment per distinct non-text argument set


def test_run_batch_runs_groups_of_different_non_text_arguments_at_once():
    """Each non-text argument set is its own first segment; the instances of all of them are in flight together
    (the double holds every gen until all three instances' first gens have arrived)."""
    items = [{"word": "sun", "n": 1}, {"word": "moon", "n": 3}, {"word": "star"}]
    gated = GatedBackend(width=len(items), reply=" x")
    states = _batch(repeat_words.compile(), items, gated)
    assert [len(st.variables()) for st in states] == [1, 3, 2]
    assert gated.peak == len(items)
