"""Differential property test: random programs (text, arguments, gen, select, fork/join, branches on selects, host
code on generated values) give the same variables and text compiled as interpreted, on the embedded model at
temperature 0."""
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import lmc as sgl

# " Answer: " then ["yes", "no"]: choices that merge with a trailing space (select lowering scores them after the
# text less its last token)
WORDS = st.sampled_from([" the", " sky", " is", " blue.", " Yes", " No", "\nQ:", " cats", " 42", " Answer: "])
CHOICES = st.sampled_from([[" yes", " no"], [" red", " green", " blue"], [" 1", " 2"], ["yes", "no"]])


def steps(depth: int):
    leaf = st.one_of(
        st.tuples(st.just("text"), WORDS),
        st.tuples(st.just("arg")),
        st.tuples(st.just("gen"), st.integers(1, 3)),
        st.tuples(st.just("select"), CHOICES),
        st.tuples(st.just("host")),  # host code on the last generated value: a graph break
    )
    if depth == 0:
        return st.lists(leaf, min_size=1, max_size=4)
    inner = steps(depth - 1)
    return st.lists(st.one_of(leaf, st.tuples(st.just("fork"), st.integers(1, 2), inner),
                              st.tuples(st.just("branch"), CHOICES, inner, inner)), min_size=1, max_size=4)


def build(plan):
    """A program whose body interprets `plan` (names are numbered in program order, so both modes agree)."""
    def run(s, items, names, in_fork, arg):
        for item in items:
            kind = item[0]
            if kind == "text":
                s += item[1]
            elif kind == "arg":
                s += " (" + arg + ")"
            elif kind == "gen":
                names.append(f"g{len(names)}")
                s += sgl.gen(names[-1], max_tokens=item[1])
            elif kind == "select":
                names.append(f"c{len(names)}")
                s += sgl.select(names[-1], choices=item[1])
            elif kind == "host" and names and not in_fork:
                value = s[names[-1]]  # a str, or a list gathered by a join
                s += f" [{len(value)}:{str(value).strip()[:3]}]"
            elif kind == "fork" and not in_fork:
                forks = s.fork(item[1])
                for f in forks:
                    run(f, item[2], names, True, arg)
                forks.join()
            elif kind == "branch":
                names.append(f"b{len(names)}")
                s += " Pick:" + sgl.select(names[-1], choices=item[1])
                run(s, item[2] if s[names[-1]] == item[1][0] else item[3], names, in_fork, arg)
        return names

    @sgl.function
    def random_program(s, question):
        s += "Q: " + question + "\nA:"
        run(s, plan, [], False, question)

    return random_program


@pytest.fixture(scope="module")
def backend(engine):
    return sgl.Local(engine=engine)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(plan=steps(1), question=st.sampled_from(["Is the sky blue?", "Name a color.", "What is 6 times 7?"]))
# a select its children score, then a fork: the branches' results reached the program before the select's
@example(plan=[("select", [" 1", " 2"]), ("fork", 1, [("gen", 1)])], question="Is the sky blue?")
# host code on a gathered list: its length is known while tracing, str() of it reads the values
@example(plan=[("fork", 1, [("gen", 1)]), ("host",)], question="Is the sky blue?")
def test_compiled_equals_interpreted_on_random_programs(backend, plan, question):
    prog = build(plan)
    interpreted = prog.run(question=question, backend=backend, temperature=0)
    compiled = prog.compile().run(question=question, backend=backend, temperature=0)
    assert compiled.variables() == interpreted.variables()
    assert compiled.text() == interpreted.text()
