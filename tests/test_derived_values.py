"""Host values derived from meta info trace into expressions (lmc.ir.expr) instead of graph breaks: arithmetic and
round() over a select's logprobs, decisions on them (max over branch scores), and items of a fork's gathered
variables. The expression a trace records evaluates to what Python computes on the concrete values (a property
test), programs that only do this compile to one segment and run like the interpreter (the embedded model,
temperature 0), and malformed expressions are refused with a message naming them."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import lmc as sgl
from lmc.compiler.lower import Plan, PlanError
from lmc.compiler.symbols import Derived, GraphBreak
from lmc.compiler.trace import trace
from lmc.ir import IRValidationError
from lmc.ir.expr import MAX_NODES, check, evaluate, format_expr, reads
from lmc.ir.text import parse_graph, print_graph
from test_examples import load

META = {"ok": {"normalized_prompt_logprobs": [-0.25, -1.5], "prompt_tokens": 7}}
_BINARY = [("+", lambda a, b: a + b), ("-", lambda a, b: a - b), ("*", lambda a, b: a * b),
           ("/", lambda a, b: a / b)]


@st.composite
def computations(draw):
    """A random computation as (a function of the logprob list, applied alike to the Derived and concrete values)."""
    steps = draw(st.lists(st.tuples(st.sampled_from(["bin", "rbin", "neg", "abs", "round"]),
                                    st.sampled_from(_BINARY), st.integers(0, 1),
                                    st.floats(-4, 4, allow_nan=False).filter(lambda x: abs(x) > 1e-3),
                                    st.integers(0, 4)), min_size=1, max_size=6))

    def run(lps):
        x = lps[0]
        for kind, (_, fn), i, c, nd in steps:
            if kind == "bin":
                x = fn(x, lps[i] if c > 0 else c)
            elif kind == "rbin":
                x = fn(c, x)
            elif kind == "neg":
                x = -x
            elif kind == "abs":
                x = abs(x)
            else:
                x = round(x, nd)
        return x

    return run


@settings(max_examples=200, deadline=None)
@given(computations())
def test_a_derived_computation_evaluates_to_what_python_computes(run):
    derived = Derived(["meta", "ok"])["normalized_prompt_logprobs"]
    try:
        expected = run(META["ok"]["normalized_prompt_logprobs"])
    except ZeroDivisionError:
        with pytest.raises(ZeroDivisionError):
            evaluate(run(derived).expr, None, META.get)
        return
    e = run(derived).expr
    assert check(e) is None and reads(e) == ["ok"] and format_expr(e)
    got = evaluate(e, None, META.get)
    assert got == expected  # the same operations in the same order: the same float


def test_reading_the_concrete_value_is_a_graph_break():
    x = Derived(["meta", "ok"])["prompt_tokens"] * 2
    for read in (str, float, int, lambda v: f"{v:.2f}", lambda v: {v}, list, len):
        with pytest.raises(GraphBreak, match=r"needs the value of \(meta\(\{ok\}\)\[\"prompt_tokens\"\] \* 2\)"):
            read(x)


@pytest.mark.parametrize("bad, message", [
    (["exec", "print(1)"], "is not an expression"),
    (["+", 1], "'+' takes 2 operand(s), not 1"),
    (["item", ["meta", "ok"], 1.5], "an item's key is an int or a str"),
    (["meta", 3], "'meta' takes a variable name"),
    (["round", 1.5, "2"], "round's ndigits is an int or null"),
    (["list", *([1] * MAX_NODES)], f"more than {MAX_NODES} nodes"),
    ({"var": "x"}, "is not an expression"),
])
def test_malformed_expressions_are_named(bad, message):
    assert message in check(bad)
    plan = {"version": 1, "program": "p", "target": "local",
            "ops": [{"op": "set", "node": 4, "name": "x", "expr": bad}]}
    with pytest.raises(PlanError, match=r"ops\[0\] \(set %4\): expr: "):
        Plan.from_json(plan)


def test_arithmetic_on_what_is_not_a_number_fails_like_python():
    with pytest.raises(TypeError, match="'-' takes numbers, not str"):
        evaluate(["-", ["var", "word"], 1], {"word": "yes"}.get, None)


@sgl.function
def margin_decision(s, question):
    s += question + " Answer yes or no: " + sgl.select("ok", choices=["yes", "no"])
    lps = s.get_meta_info("ok")["normalized_prompt_logprobs"]
    s["margin"] = round(lps[0] - lps[1], 3)
    s["both"] = [s["margin"], lps[1], "yes"]
    if abs(s["margin"]) > 0.5:
        s += "\nSure. Say why:" + sgl.gen("why", max_tokens=6, stop="\n")
    else:
        s += "\nUnsure. Say why:" + sgl.gen("why", max_tokens=6, stop="\n")


@sgl.function
def best_branch(s, topic):
    s += "Three words about " + topic + "."
    forks = s.fork(3)
    for i, f in enumerate(forks):
        f += f"\nWord {i + 1}:" + sgl.gen("word", max_tokens=3, stop="\n")
        f += "\nGood?" + sgl.select("good", choices=[" yes", " no"])
    forks.join()
    metas = s.get_meta_info("good")
    best = max(range(3), key=lambda i: metas[i]["normalized_prompt_logprobs"][0])
    s["best"] = best
    s += "\nThe best word:" + s["word"][best].strip() + ". Why?" + sgl.gen("why", max_tokens=6, stop="\n")


@sgl.function
def gathered_str(s, question):
    s += question
    forks = s.fork(2)
    for f in forks:
        f += " A:" + sgl.gen("g", max_tokens=3)
    forks.join()
    value = s["g"]  # a list of the branches' values: its length is known, str() of it reads them (a break)
    s += f" [{len(value)}:{str(value).strip()[:3]}]" + sgl.gen("after", max_tokens=3)


def test_decisions_on_derived_values_compile_to_one_segment():
    g = trace(margin_decision).validate()
    assert g.static() and g.count("branch") == 1
    [margin, both] = [g.node(n).attrs for n in g.order() if g.node(n).kind == "set_var"][:2]
    assert margin["expr"][0] == "round" and both["expr"][0] == "list" and both["expr"][-1] == "yes"
    g = trace(best_branch).validate()
    assert g.static() and g.count("branch") == 3  # max over 3: two comparisons on each of 2 paths, shared first
    items = {g.node(n).attrs.get("index") for n in g.order() if g.node(n).kind == "var"}
    assert items == {0, 1, 2}


def test_a_graph_that_reads_an_undefined_variable_in_an_expression_is_refused():
    g = trace(margin_decision)
    n = next(n for n in g.order() if g.node(n).kind == "set_var")
    g.node(n).attrs["expr"] = ["meta", "nope"]
    with pytest.raises(IRValidationError, match=f"%{n} reads variable 'nope'"):
        g.validate()


@pytest.mark.parametrize("prog, args", [(margin_decision, {"question": "Is the sky blue?"}),
                                        (best_branch, {"topic": "rain"}), (gathered_str, {"question": "Sky?"})],
                         ids=["margin", "best_branch", "gathered_str"])
def test_derived_values_run_compiled_like_the_interpreter(engine, prog, args):
    backend = sgl.Local(engine=engine)
    interpreted = prog.run(backend=backend, temperature=0, **args)
    compiled = prog.compile()
    state = compiled.run(backend=backend, temperature=0, **args)
    assert [b["reason"] for b in compiled.breaks()[1]] == (
        [] if prog is not gathered_str else ["str() of a gathered list needs the value of generated 'g'"])
    assert state.variables() == interpreted.variables() and state.text() == interpreted.text()


def test_tree_of_thought_is_one_segment():
    """Its host code (scores from the selects' logprobs, the best branch, its thought) is all derived values."""
    g = trace(load("tree_of_thought").tree_of_thought).validate()
    assert g.static() and g.count("break") == 0
    assert parse_graph(print_graph(g)) == g  # its expressions print and parse back (.lmir: JSON attributes)
