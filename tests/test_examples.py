"""Every example's program, once, on the embedded model at temperature 0 (through the Python API, one shared
engine). The examples are weak-model demos: these check structure and a few facts the 135M model gets right."""
import importlib.util
from pathlib import Path

import pytest

import lmc

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
PROGRAM_FILES = ["few_shot_qa", "multi_turn_chat", "classification", "tip_suggestion", "tree_of_thought", "judge",
                 "react_agent", "extraction", "calculator_agent", "counted_list"]


def load(name: str):
    """Import an example by path (its __main__ block does not run)."""
    spec = importlib.util.spec_from_file_location(f"_lmc_example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def backend(engine):
    return lmc.Local(engine=engine)


@pytest.mark.parametrize("name", PROGRAM_FILES)
def test_example_defines_one_program(name):
    """`lmc run examples/<name>.py` needs no :name."""
    programs = [v for v in vars(load(name)).values() if isinstance(v, lmc.Program)]
    assert len(programs) == 1


def test_few_shot_qa(backend):
    state = load("few_shot_qa").few_shot_qa.run(question="What is the capital of France?", temperature=0,
                                                backend=backend)
    assert "Paris" in state["answer"] and "\n" not in state["answer"]


def test_multi_turn_chat(backend):
    state = load("multi_turn_chat").multi_turn_chat.run(
        question_1="What is the capital of France?", question_2="What language do people speak there?",
        temperature=0, backend=backend)
    assert [m["role"] for m in state.messages()] == ["system", "user", "assistant", "user", "assistant"]
    assert "Paris" in state["answer_1"] and state["answer_2"].strip()
    assert state.messages()[4]["content"] == state["answer_2"].strip()


def test_classification(backend):
    classify = load("classification").classify
    pos = classify.run(text="I love this movie, it was fantastic!", temperature=0, backend=backend)
    neg = classify.run(text="This is the worst meal I have ever eaten.", temperature=0, backend=backend)
    assert (pos["label"], neg["label"]) == ("positive", "negative")
    assert len(pos.get_meta_info("label")["normalized_prompt_logprobs"]) == 2


def test_tip_suggestion(backend):
    state = load("tip_suggestion").tip_suggestion.run(topic="staying healthy", temperature=0, backend=backend)
    assert len(state["tips"]) == 3 and all(state["tips"])
    assert len(state["expansion"]) == 3 and all(e.strip() for e in state["expansion"])
    assert state["summary"].strip()
    for tip in state["tips"]:  # the joined expansions went into the summary prompt
        assert tip in state.text()


def test_tree_of_thought(backend):
    mod = load("tree_of_thought")
    state = mod.tree_of_thought.run(question="What is 2 + 3?", temperature=0, backend=backend)
    assert len(state["thought"]) == len(state["scores"]) == len(state["correct"]) == 3
    assert all(c in ("yes", "no") for c in state["correct"])
    assert state["scores"][state["best"]] == max(state["scores"])
    assert mod.APPROACHES[state["best"]] + state["thought"][state["best"]].rstrip() in state.text()
    assert state["answer"].strip()


def test_judge(backend):
    mod = load("judge")
    state = mod.judge.run(question="What is the capital of France?", answer="The capital of France is Paris.",
                          temperature=0, backend=backend)
    assert list(state["scores"]) == list(mod.DIMENSIONS)  # one score per dimension
    assert all(1 <= x <= 5 for x in state["scores"].values())
    assert len(state["score"]) == len(state["reason"]) == len(mod.DIMENSIONS)
    assert state["verdict"] in ("yes", "no")


def test_react_agent(backend):
    mod = load("react_agent")
    state = mod.react_agent.run(question="What is the capital of Italy?", temperature=0, backend=backend)
    steps = state["steps"]
    assert 1 <= len(steps) <= 3 and steps[-1]["action"] == "finish"  # finished within its step limit
    assert all(s["action"] in mod.ACTIONS for s in steps)
    assert {"thought", "action", "action_input", "answer", "steps"} <= set(state.variables())
    assert "Rome" in state["answer"]


def test_calculator_agent(backend):
    mod = load("calculator_agent")
    assert (mod.calculate("12 * 7 + 5"), mod.calculate("2 / 0")) == ("89", "error: division by zero")
    assert mod.calculate("__import__('os')").startswith("error")  # the tool evaluates arithmetic only
    state = mod.calculator_agent.run(question="What is 12 times 7, plus 5?", temperature=0, backend=backend)
    lines = state.text()[len(mod.PROMPT):].splitlines()
    actions = [ln for ln in lines if ln.startswith("Action ")]
    assert 1 <= len(actions) <= 3 and state["action"] in mod.ACTIONS
    for action, obs in zip(actions, [ln for ln in lines if ln.startswith("Observation ")]):
        expr = action.split("calculate[", 1)[1].rsplit("]", 1)[0]  # each observation is the tool's result
        assert obs.split(": ", 1)[1] == mod.calculate(expr)
    assert state["answer"] == state["action_input"].strip()


def test_counted_list(backend):
    state = load("counted_list").counted_list.run(topic="fruits", temperature=0, backend=backend)
    count = int(state["count"])
    assert 2 <= count <= 4
    assert sorted(k for k in state.variables() if k.startswith("item_")) == [f"item_{i + 1}" for i in range(count)]
    assert state["favourite"].strip()
